"""The input conversions, fp32 islands and default-dtype scopes a policy applies to a model.

Plain, self-contained PyTorch on purpose: the exports paste these very functions into the user's
script (``mixprec.exports.snippets`` emits them with ``inspect.getsource``), so an export and
``Policy.prepare()`` convert inputs, wrap fp32 islands and set the default dtype with one copy of
the code. Code here may use only ``torch`` and the standard-library names in :data:`STDLIB` and
:data:`STDLIB_NAMES`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

# What emitted code may use besides torch: module -> import line, name -> "from" import.
STDLIB = {"contextlib": "contextlib", "fnmatch": "fnmatch", "functools": "functools"}
STDLIB_NAMES = {"Callable": "collections.abc", "Iterator": "collections.abc", "Any": "typing"}


def cast_floating(value: Any, dtype: torch.dtype, widen_only: bool = False) -> Any:
    """Cast the floating-point tensors in value (nested lists, tuples, dicts) to dtype; with
    widen_only, only those narrower than dtype (a float64 tensor stays float64 under fp32)."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or (widen_only and value.dtype.itemsize >= dtype.itemsize):
            return value
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype, widen_only) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype, widen_only) for k, v in value.items()}
    return value


def to_channels_last(value: Any) -> Any:
    """4-D floating-point tensors in value (nested lists, tuples, dicts) to channels_last."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 4 and value.is_floating_point():
            return value.contiguous(memory_format=torch.channels_last)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(to_channels_last(v) for v in value)
    if isinstance(value, dict):
        return {k: to_channels_last(v) for k, v in value.items()}
    return value


class CastInputs:
    """A forward pre-hook (register it with with_kwargs=True) that casts the module's floating-point
    inputs to dtype, positional and keyword alike, except the keyword arguments named in keep. An
    object, not a closure, so that torch.save(model) can pickle a model that carries it."""

    def __init__(self, dtype: torch.dtype, keep: tuple[str, ...] = ()) -> None:
        self.dtype, self.keep = dtype, keep

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = {k: v if k in self.keep else cast_floating(v, self.dtype) for k, v in kwargs.items()}
        return cast_floating(args, self.dtype), kwargs


def cast_inputs(dtype: torch.dtype, keep: tuple[str, ...] = ()) -> Callable:
    """A forward pre-hook (register it with with_kwargs=True) that casts the module's floating-point
    inputs to dtype, positional and keyword alike, except the keyword arguments named in keep."""
    return CastInputs(dtype, keep)


def channels_last_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook (with_kwargs=True): 4-D floating-point inputs, positional and keyword, to
    channels_last."""
    return to_channels_last(args), to_channels_last(kwargs)


def fp32_islands(model: torch.nn.Module, patterns: list[str]) -> dict[str, torch.nn.Module]:
    """The modules of model whose names match a keep_fp32 glob pattern (as mixprec's keep_fp32)."""
    named = {name: module for name, module in model.named_modules() if name}
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in named):
            raise ValueError(f"keep_fp32 pattern {pattern!r} matches no module of {type(model).__name__}")
    return {name: m for name, m in named.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)}


def matches_any(name: str, patterns: list[str]) -> bool:
    """Whether a module name matches one of the glob patterns (keep_fp32, the keep_bf16 map)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class Fp32Island:
    """The forward of an fp32 island (keep_in_fp32 makes it the module's ``forward``): the module's
    own forward outside autocast, its half-precision inputs widened to fp32 (float64 ones stay
    float64: an island never narrows), its outputs cast to output_dtype if given. An object holding
    the module's bound forward, not a closure over it: a copy of the model (copy.deepcopy: an EMA,
    a best-so-far snapshot) then computes its island with the copy's own weights (a closure kept
    calling the original module), and torch.save(model) can pickle it."""

    __wrapped__: Callable  # the module's own forward (set by functools.update_wrapper)

    def __init__(self, forward: Callable, device_type: str, output_dtype: torch.dtype | None = None) -> None:
        functools.update_wrapper(self, forward)  # (its signature and name are the forward's)
        self.device_type, self.output_dtype = device_type, output_dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # outside autocast, nothing to leave (a disabled autocast entered there, in a script that
        # mixprec runs, reads as the script's AMP switched off, also where torch.compile enters it)
        on = torch.is_autocast_enabled(self.device_type)
        with torch.autocast(self.device_type, enabled=False) if on else contextlib.nullcontext():
            args, kwargs = (
                cast_floating(args, torch.float32, True),
                cast_floating(kwargs, torch.float32, True),
            )
            out = self.__wrapped__(*args, **kwargs)
        return out if self.output_dtype is None else cast_floating(out, self.output_dtype)


def keep_in_fp32(
    module: torch.nn.Module, device_type: str, output_dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """Run module outside autocast with its half-precision inputs widened to fp32 (float64 ones stay
    float64: an island never narrows); cast its outputs to output_dtype if given."""
    if getattr(module, "_fp32_island", False):
        return module
    module.forward = Fp32Island(module.forward, device_type, output_dtype)
    module._fp32_island = True  # type: ignore[assignment]
    return module


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make dtype the default dtype inside the block (tensors created without a dtype get it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def default_dtype_in_forward(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Run module's forward with dtype as the default dtype, restored afterwards (also on errors)."""
    saved = []

    def enter(mod: torch.nn.Module, args: tuple) -> None:
        saved.append(torch.get_default_dtype())
        torch.set_default_dtype(dtype)

    def leave(mod: torch.nn.Module, args: tuple, output: object) -> None:
        torch.set_default_dtype(saved.pop())

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    return module


class HalfGradScaler(torch.amp.GradScaler):
    """GradScaler that also unscales fp16 gradients (refused by default); fp16-true has only those."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # private GradScaler hook
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


def keep_batch_norm_fp32(model: torch.nn.Module) -> list[str]:
    """Under a *-true policy, BatchNorm layers keep fp32 weights and running statistics (Apex O2's
    ``keep_batchnorm_fp32``): a running variance accumulated in fp16 overflows to inf on large
    activations, leaving the model broken for eval, and bf16's 8 bits blur the statistics. PyTorch's
    batch norm takes half inputs with fp32 parameters (cuDNN and the CPU kernel alike) and returns
    the input's dtype, so the layers around it see no change. Returns the layers' names."""
    kept = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.float()
            kept.append(name)
    return kept


def refuse_split_ties(model: torch.nn.Module, islands: dict[str, torch.nn.Module]) -> None:
    """Under a *-true policy, a weight shared by an fp32 island and a module outside it (a tied
    embedding and LM head) cannot be both fp32 and half: raise ValueError naming both paths
    instead of failing at the first matmul."""
    inside = {id(p) for m in islands.values() for p in m.parameters()}
    paths: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(name)
    for key, names in paths.items():
        if key not in inside or len(names) < 2:
            continue
        kept = [n for n in names if any(n.startswith(i + ".") for i in islands)]
        left = [n for n in names if n not in kept]
        if left:
            raise ValueError(
                f"keep_fp32 splits a tied weight: {kept[0]!r} is the same tensor as {left[0]!r}, and a "
                "*-true policy cannot store it in fp32 for one and half precision for the other; keep "
                f"both modules in fp32 (add {left[0].rsplit('.', 1)[0]!r} to keep_fp32) or neither."
            )


class OwnHook:
    """A forward (pre-)hook mixprec puts on one of the user's modules: ``call`` runs for that module
    alone. A deep copy of the module (an EMA, a snapshot, a teacher) shares this object, on which it
    is inert: the copy's forwards are not the module's (nn.DataParallel's replicas, which share the
    module's hooks dict to run its forward on each GPU, are the module). A pickled module holds an
    inert one."""

    def __init__(self, call: Callable[..., Any] | None, module: torch.nn.Module | None) -> None:
        self.call, self.module = call, module

    def __call__(self, module: torch.nn.Module, *rest: Any) -> Any:
        if self.call is None or (module is not self.module and not getattr(module, "_is_replica", False)):
            return None
        return self.call(module, *rest)

    def __deepcopy__(self, memo: dict) -> OwnHook:
        return self

    def __reduce__(self) -> tuple:
        return (OwnHook, (None, None))
