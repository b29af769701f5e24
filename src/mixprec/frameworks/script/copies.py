"""The script's copies of its model.

Scripts copy their model: ``AveragedModel(model)`` and timm's ``ModelEmaV3`` (an EMA),
``copy.deepcopy(model)`` (a best-so-far snapshot, a teacher), ``torch.save(model)`` (the whole
module pickled). What the agent sets on the model stays behind in a copy: a bound method of the
agent as a forward hook made every one of them fail (deepcopy copied the agent through it: "cannot
pickle 'generator' object"), and a compiled forward set on the model (a function holding the
original's bound forward) made a deep copy compute with the original's weights. Here, a copy gets
an inert hook and its own eager forward.

A copy made *before* the agent applied the candidate (an EMA built before the optimizer) is the
other way round: it keeps the script's dtypes while the model takes the candidate's, and the first
``torch._foreach_lerp_`` between them fails. :func:`copies_of` finds such copies and :func:`follow`
gives them what the model got, as if the script had been edited by hand before it made them.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from mixprec.frameworks.script.models import live_modules
from mixprec.policy.hooks import CastInputs, Fp32Island, OwnHook, keep_in_fp32

__all__ = ["CompiledForward", "OwnHook", "copies_of", "follow"]


class CompiledForward:
    """``model.forward`` compiled (a compile candidate) so that the agent's hooks on the model stay
    eager. A deep copy of the model runs its own forward, eager; a pickled model, its class's."""

    __wrapped__: Callable[..., Any]  # the model's eager forward (set by functools.update_wrapper)

    def __init__(self, forward: Callable[..., Any], mode: str | None) -> None:
        functools.update_wrapper(self, forward)  # (its signature: HF's generate() reads it)
        self.compiled = torch.compile(forward, mode=mode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self.__wrapped__, memo)  # (a bound method: bound to the copy, in memo)

    def __reduce__(self) -> str | tuple[Any, ...]:
        return self.__wrapped__.__reduce__()


def copies_of(model: nn.Module, within: nn.Module | None = None) -> list[nn.Module]:
    """The modules outside ``model`` that are copies of it as it is now: the same parameter names,
    shapes, dtypes and values, none of them the model's own tensor (AveragedModel's ``module``,
    timm's ``ModelEmaV3``, a ``copy.deepcopy`` teacher). A module of the same shape with other
    values (a teacher loaded from a checkpoint) is not one, nor one inside ``within`` (the model a
    part belongs to: two towers made equal are both trained). ``model`` is read inside its DDP or
    compile wrapper: an EMA copied before the wrapping has the inner module's names."""
    core = unwrapped(model)
    mine = dict(core.named_parameters())
    if not mine or not all(_readable(p) for p in mine.values()):
        return []
    shape = [(n, p.shape, p.dtype) for n, p in mine.items()]
    inside = {id(m) for m in (within or model).modules()}
    found = []
    for module in live_modules():
        if id(module) in inside:
            continue
        theirs = dict(module.named_parameters())
        if len(theirs) != len(mine) or not all(_readable(p) for p in theirs.values()):
            continue  # (a meta skeleton, a lazy module not yet built: no values to compare)
        if [(n, p.shape, p.dtype) for n, p in theirs.items()] != shape:
            continue
        if any(theirs[n] is p for n, p in mine.items()):
            continue  # (shares the model's weights: a view of it, not a copy)
        with torch.no_grad():  # (on the copy's device: timm's ModelEmaV3 may keep it on the CPU)
            if all(torch.equal(theirs[n], p.to(theirs[n].device)) for n, p in mine.items()):
                found.append(module)
    return found


def unwrapped(model: nn.Module) -> nn.Module:
    """The module inside DDP / DataParallel (``module``) and torch.compile (``_orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _readable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds values to compare: not on the meta device, not a lazy module's
    uninitialized parameter."""
    return not isinstance(tensor, UninitializedTensorMixin) and not tensor.is_meta


def follow(model: nn.Module, copies: list[nn.Module]) -> None:
    """Give each copy what the candidate gave the model: its dtypes and values, name by name (fp32
    islands and BatchNorm stay fp32 where the model's do, rounded where the model's were), its input
    casts and its fp32 islands."""
    core = unwrapped(model)
    tensors = dict([*core.named_parameters(), *core.named_buffers()])
    casts = [hook for hook in model._forward_pre_hooks.values() if isinstance(hook, CastInputs)]
    islands = {
        n: m.__dict__["forward"]
        for n, m in core.named_modules()
        if isinstance(m.__dict__.get("forward"), Fp32Island)
    }
    for twin in copies:
        # the copy was the model's equal: it takes the prepared model's tensors (their dtypes and
        # rounded values), each on the copy's own device
        source = {
            id(t): tensors[n]
            for n, t in [*twin.named_parameters(), *twin.named_buffers()]
            if n in tensors and t.is_floating_point()
        }
        twin._apply(
            lambda t, source=source: source[id(t)].detach().to(t.device, copy=True) if id(t) in source else t
        )
        for cast in casts:
            twin.register_forward_pre_hook(cast, with_kwargs=True)
        for name, island in islands.items():
            keep_in_fp32(twin.get_submodule(name), island.device_type, island.output_dtype)
