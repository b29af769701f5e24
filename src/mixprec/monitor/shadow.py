"""The fp32 shadow: the same batch through the same weights in strict fp32, leaving the run as it
was (weights untouched, gradients, buffers and the RNG restored), to tell the data from the
precision."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec import state
from mixprec.frameworks.torch.ranges import collect_ranges
from mixprec.numerics.compare import sqnr_db
from mixprec.policy.registry import POLICIES
from mixprec.policy.scaler import dense

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Restore the gradients, the buffers (BatchNorm statistics) and the RNG after the body."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads.items():
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextlib.contextmanager
def _own_forward(model: nn.Module) -> Iterator[None]:
    """The model's own forward for the body, where Accelerate wrapped it in its autocast (the HF
    Trainer's model, an Accelerate loop's: ``model._original_forward``), so fp32 is fp32."""
    original, wrapped = model.__dict__.get("_original_forward"), model.__dict__.get("forward")
    if original is None or wrapped is None:
        yield
        return
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapped


def _fp32(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Strict fp32 for the body: autocast off, TF32/bf32 off (weights are fp32 under *-mixed)."""
    stack = contextlib.ExitStack()
    device = next(model.parameters()).device.type
    stack.enter_context(torch.autocast(device, enabled=False))
    stack.enter_context(state.precision_settings(POLICIES["fp32"].precision))
    stack.enter_context(_own_forward(model))
    return stack


@dataclass
class Replay:
    """A batch replayed from the run's weights: its loss, its gradient norm (when the backward ran)
    and, where asked, its gradients (unscaled), for a retry."""

    loss: float
    grad_norm: float | None = None
    grads: list[torch.Tensor | None] | None = None


def grad_norm(params: Sequence[torch.Tensor]) -> float:
    """The 2-norm of the gradients of ``params`` (one read)."""
    grads = [dense(p.grad).detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads)
    return float(torch.linalg.vector_norm(torch.stack([n.float().to(norms[0].device) for n in norms])))


def replay(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    *,
    fp32: bool = False,
    backward: bool = True,
    scale: float | None = None,
    keep_grads: bool = False,
) -> Replay:
    """``batch`` once more from the weights as they are (the update not applied yet): in strict fp32
    (``fp32=True``) or under the run's ``context`` (its autocast), forward and, with ``backward``,
    backward (scaled by ``scale``, the gradients unscaled after); the run left as it was (its
    gradients, buffers and RNG restored). ``keep_grads``: the replay's gradients come back, for a
    retry."""
    params = [p for p in model.parameters() if p.requires_grad]
    with untouched(model), torch.enable_grad() if backward else torch.no_grad():
        if backward:
            for p in params:
                p.grad = None
        with _fp32(model) if fp32 else context() if context is not None else contextlib.nullcontext():
            loss = loss_fn(model, batch)
            value = float(loss.detach().float())
            if not backward:
                return Replay(value)
            (loss.float() * scale if scale else loss).backward()
        if scale:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / scale)
        norm = grad_norm(params)
        grads = [p.grad for p in params] if keep_grads else None
    return Replay(value, norm, grads)


def fp32_loss(model: nn.Module, loss_fn: LossFn, batch: Any) -> float:
    """The loss of ``batch`` in strict fp32, forward only."""
    with untouched(model), torch.no_grad(), _fp32(model):
        return float(loss_fn(model, batch).detach().float())


def control_fails(
    model: nn.Module, loss_fn: LossFn, control: Any, suspect: Any, spikes: Callable[[float], bool]
) -> float | None:
    """Where a suspect batch spikes in strict fp32 too: the fp32 loss of ``control`` (a batch whose
    loss was normal) from the same weights when it ``spikes`` as well (the weights fail on any batch:
    the run diverges in fp32, not the data), else None (no control, or it is fine: the batch)."""
    if control is None or control is suspect:
        return None
    try:
        value = fp32_loss(model, loss_fn, control)
    except Exception:  # (a control that cannot be replayed says nothing)
        return None
    return value if spikes(value) else None


def first_nonfinite(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    autocast: contextlib.AbstractContextManager[Any],
    scale: float | None,
) -> str | None:
    """The first module whose output (or, failing that, gradient) is not finite on ``batch`` under
    ``autocast``, the backward scaled by ``scale``; the run restored afterwards."""

    def step() -> torch.Tensor:
        with autocast:
            return loss_fn(model, batch)

    with untouched(model):
        report = collect_ranges(model, step, loss_scale=scale)
    return report.first_nonfinite_forward or report.first_nonfinite_backward


def _grads(model: nn.Module, loss_fn: LossFn, batch: Any, scale: float | None) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    loss = loss_fn(model, batch)
    (loss * scale if scale else loss).backward()
    parts = [
        dense(p.grad).detach().float().reshape(-1) / (scale or 1.0)
        for p in model.parameters()
        if p.grad is not None
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


def shadow_sqnr(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    scale: float | None,
) -> float | None:
    """Gradient SQNR (dB) of the policy's step against strict fp32 on ``batch`` (forward and
    backward twice, no optimizer step, the run restored); None when the model's weights are not
    fp32 (a *-true model has no fp32 step to shadow it with)."""
    if any(p.dtype != torch.float32 for p in model.parameters() if p.is_floating_point()):
        return None
    with untouched(model):
        with autocast() if autocast is not None else contextlib.nullcontext():
            candidate = _grads(model, loss_fn, batch, scale)
        with _fp32(model):
            reference = _grads(model, loss_fn, batch, None)
    return sqnr_db(reference, candidate)
