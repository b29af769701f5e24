"""Up-front validation: one strict-fp32 training step in this process, before any measuring.

A workload whose ``make_batch`` raises, whose ``loss_fn`` returns the model's output object
instead of a scalar, or whose optimizer covers another model's parameters would otherwise fail
in every candidate alike, deep inside a sweep, as rows of the same error (or, worse, as "no
candidate passed"). Here each mistake is one :class:`~mixprec.errors.UsageError` naming the
function and what it returned, e.g. ``loss_fn returned
transformers.modeling_outputs.SequenceClassifierOutput; return a scalar tensor, e.g. `out.loss```.

Running out of memory is not a mistake of the workload: validation then stops quietly and the
sweep reports the candidates as ``oom``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch import nn

from mixprec.errors import UsageError, is_out_of_memory
from mixprec.hardware.device import resolve_device
from mixprec.policy import get_policy
from mixprec.workload.workload import Workload

_DEBUG = "(run it directly, or use 'mixprec --debug', to see the traceback)"


class _OutOfMemory(Exception):
    """The step ran out of memory: nothing to say about the workload itself."""


def validate_workload(
    workload: Workload, *, device: str | torch.device | None = None, batch_size: int | None = None
) -> None:
    """One strict-fp32 step of ``workload`` at ``batch_size`` on ``device``, checking every part.

    ``make_batch`` must return tensors on ``device``; ``loss_fn`` a finite scalar floating-point
    tensor with a gradient path to the model it is given; ``optimizer_fn`` an optimizer over that
    model's parameters that steps. Raises :class:`UsageError` for the first part that does not.
    The workload's model, its RNG and the caller's RNG are left as they were; the same workload
    parts at the same device and batch size that passed once are not run again.
    """
    if not isinstance(workload, Workload):
        raise UsageError(f"validate_workload() takes a mixprec.Workload, got {type(workload).__name__}.")
    dev = resolve_device(device)
    bs = batch_size or workload.default_batch_size
    parts = (workload.model, workload.make_batch, workload.loss_fn, workload.optimizer_fn)
    key = (str(dev), int(bs), *(id(part) for part in parts))
    if key in workload._validated:
        return
    try:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            _one_step(workload, dev, bs)
    except _OutOfMemory:
        return
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    workload._validated.add(key)


def checked_batch(workload: Workload, batch_size: int, device: torch.device) -> Any:
    """``workload.make_batch(batch_size, device)``, or one :class:`UsageError` line saying what is
    wrong with it (it raised, returned no tensor, or tensors on another device)."""
    args = f"({batch_size}, {str(device)!r})"
    batch = _call("make_batch", workload.make_batch, batch_size, device, args=args)
    check_batch(batch, device, batch_size)
    return batch


def _one_step(workload: Workload, dev: torch.device, bs: int) -> None:
    policy = get_policy("fp32", device=dev)
    batch = checked_batch(workload, bs, dev)
    model = policy.prepare(copy.deepcopy(workload.model))
    model.train()
    floating = [p for p in model.parameters() if p.is_floating_point()]
    if not any(p.requires_grad for p in floating):
        raise UsageError(
            f"the model has no parameter that requires grad ({len(floating)} floating-point parameters, "
            "all frozen): nothing would train, and no precision can be measured on it; unfreeze the "
            "layers to train (p.requires_grad_(True))."
        )
    with policy.precision_scope():
        with policy.autocast():
            loss = _call("loss_fn", workload.loss_fn, model, batch, args="(model, batch)")
        check_loss(loss)
        _call("loss.backward", policy.backward, loss, args="()", own=False)
        if not any(p.grad is not None for p in model.parameters()):
            raise UsageError(
                f"loss_fn's loss reached none of the {_count(model)} parameters of the model it was "
                "given: no gradient at all. loss_fn must call the model it receives "
                "(loss_fn(model, batch)), not a model it closed over."
            )
        optimizer = _make_optimizer(workload, model)
        check_optimizer(optimizer, model, workload)
        _call("optimizer.step", policy.step, optimizer, args="()", own=False)


def _make_optimizer(workload: Workload, model: nn.Module) -> torch.optim.Optimizer:
    """``workload.make_optimizer(model)``: it calls optimizer_fn with the module (or, the older form
    found by calling it, the parameters); an optimizer_fn that fails both ways is its one line."""
    return _call("optimizer_fn", workload.make_optimizer, model, args="(model)", own=False)


def _call(
    what: str, fn: Callable[..., Any], *call_args: Any, args: str, own: bool = True, hint: str = ""
) -> Any:
    """``fn(*call_args)``; its exception as one line naming ``what`` (out of memory: skipped)."""
    try:
        return fn(*call_args)
    except torch.OutOfMemoryError as exc:
        raise _OutOfMemory() from exc
    except UsageError:
        raise
    except Exception as exc:
        if is_out_of_memory(type(exc).__name__, str(exc)):  # the CPU allocator's RuntimeError too
            raise _OutOfMemory() from exc
        message = str(exc).splitlines()[0] if str(exc) else ""
        name = getattr(fn, "__name__", "") if own else ""
        shown = f"{what}={name}" if name and name not in (what, "<lambda>") else what
        raise UsageError(
            f"{shown}{args} raised {type(exc).__name__}: {message}; fix it {_DEBUG}.{hint}"
        ) from exc


def type_name(value: Any) -> str:
    """``transformers.modeling_outputs.SequenceClassifierOutput``; builtins without a module."""
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def tensors(value: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a batch (tuples, lists, dicts, dataclasses), with where it sits."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from tensors(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from tensors(v, f"{path}[{i}]")
    elif is_dataclass(value) and not isinstance(value, type):
        for f in fields(value):
            yield from tensors(getattr(value, f.name), f"{path}.{f.name}")


def _same_device(tensor_device: torch.device, dev: torch.device) -> bool:
    if tensor_device.type != dev.type:
        return False
    if dev.type == "cuda":
        want = dev.index if dev.index is not None else torch.cuda.current_device()
        return (tensor_device.index or 0) == want
    return True


def check_batch(batch: Any, dev: torch.device, bs: int) -> None:
    found = list(tensors(batch))
    if not found:
        raise UsageError(
            f"make_batch({bs}, {str(dev)!r}) returned {type_name(batch)} with no tensor in it; return "
            "the batch as tensors (a tensor, or a tuple/list/dict of them) created on `device`."
        )
    for path, t in found:
        if not _same_device(t.device, dev):
            raise UsageError(
                f"make_batch({bs}, {str(dev)!r}) returned {path} on {t.device}, not on {dev}; create "
                "it with device=device or move it with .to(device)."
            )


def loss_hint(value: Any) -> str:
    """How to get the scalar out of what loss_fn returned."""
    if isinstance(getattr(value, "loss", None), torch.Tensor):
        return "e.g. `out.loss`"
    if isinstance(value, Mapping) and isinstance(value.get("loss"), torch.Tensor):
        return "e.g. `out['loss']`"
    if isinstance(value, (tuple, list)):
        scalars = [i for i, v in enumerate(value) if isinstance(v, torch.Tensor) and v.numel() == 1]
        if scalars:
            return f"e.g. `out[{scalars[0]}]`"
    return "e.g. `F.cross_entropy(logits, labels)`"


def check_loss(loss: Any, *, values: bool = True) -> None:
    """``loss`` must be a scalar floating-point tensor; with ``values`` also finite and with a
    gradient path (False for a trace on the meta device, where neither can be known)."""
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"loss_fn returned {type_name(loss)}; return a scalar tensor, {loss_hint(loss)}.")
    if loss.numel() != 1:
        raise UsageError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; return a scalar, e.g. `loss.mean()`."
        )
    if not loss.is_floating_point():
        raise UsageError(
            f"loss_fn returned a {str(loss.dtype).removeprefix('torch.')} tensor; return a floating-point "
            "loss (integer values have no gradient)."
        )
    if not values:
        return
    if not loss.requires_grad:
        raise UsageError(
            "loss_fn returned a tensor without a gradient path (requires_grad=False): computed under "
            "torch.no_grad(), detached, or rebuilt from .item()? Return the loss the model computed."
        )
    value = float(loss.detach().float())
    if not math.isfinite(value):
        raise UsageError(
            f"loss_fn returned {value} at the first strict-fp32 step: the workload is broken before any "
            "precision is changed; check the model's initialisation, make_batch's data and the loss."
        )


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, workload: Workload) -> None:
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    own = {id(p) for p in model.parameters()}
    if held and not held & own:
        form = "model" if workload.optimizer_takes_module else "model.parameters()"
        raise UsageError(
            f"optimizer_fn returned {type_name(optimizer)} over {len(held)} parameter(s), none of them "
            f"the model's: build it from the {form} it is given, not from a model it closed over."
        )
    if not held:
        raise UsageError(
            f"optimizer_fn returned {type_name(optimizer)} with no parameters; build it from the model "
            "it is given."
        )


def _count(model: nn.Module) -> int:
    return sum(1 for _ in model.parameters())
