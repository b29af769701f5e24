"""The training loop's lines every target that writes a loop shares: the loss inside the policy's
context, the GradScaler with the policy's options, gradient accumulation over micro-batches, and
the snippets the loss needs."""

from __future__ import annotations

import torch

from mixprec.exports.facts import Facts
from mixprec.exports.text import DTYPE_CODE, indent, py

SCALER_ARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
SCHEDULER = "scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)  # yours"


def grad_scaler_lines(facts: Facts, cls: str, device: str, target: str = "scaler") -> list[str]:
    """``scaler = cls(device, init_scale=..., ...)`` with the policy's four GradScaler options."""
    opts = facts.scaler
    assert opts is not None
    return [
        f"{target} = {cls}(",
        f"    {device},",
        *(f"    {name}={py(getattr(opts, name))}," for name in SCALER_ARGS),
        ")",
    ]


def loss_lines(
    facts: Facts, model: str = "model", autocast: str | None = None, divide: bool = True
) -> list[str]:
    """``loss = loss_fn(model, batch)`` inside the policy's context: autocast for *-mixed, the half
    default dtype for *-true (tensors that forward creates get the weights' dtype), none otherwise.

    ``autocast``: the stack's own autocast context expression, e.g. ``accelerator.autocast()``.
    ``divide``: with gradient accumulation, divide the loss by ``accumulation_steps`` (False where
    the stack's backward divides it itself: Accelerate, DeepSpeed).
    """
    call = f"loss = loss_fn({model}, batch)"
    if facts.accumulates and divide:
        call += " / accumulation_steps  # the mean over the step's micro-batches"
    if facts.mixed is not None:
        ctx = autocast or f"torch.autocast(device_type, dtype={DTYPE_CODE[facts.mixed]})"
        return [f"    with {ctx}:", f"        {call}"]
    if facts.true is not None:
        return [f"    with default_dtype({DTYPE_CODE[facts.true]}):", f"        {call}"]
    return [f"    {call}"]


def accumulation_lines(facts: Facts) -> list[str]:
    """``accumulation_steps = k`` for the loops that count micro-batches themselves; nothing without
    accumulation."""
    if not facts.accumulates:
        return []
    m, k = facts.micro_batch, facts.accumulation_steps
    return [
        f"accumulation_steps = {k}  # micro-batches of {m} per optimizer step:"
        f" {facts.effective_batch} samples"
    ]


def loader_comment(facts: Facts) -> str:
    """The comment on ``for ... in loader:`` that says the batch size the loader must yield."""
    if facts.micro_batch is None:
        return ""
    what = "micro-batches" if facts.accumulates else "batches"
    return f"  # {what} of {facts.micro_batch}: DataLoader(..., batch_size={facts.micro_batch})"


def loop_head(facts: Facts, count: bool = True) -> str:
    """``for batch in loader:``, counting the micro-batches (from 1) where the loop accumulates and
    ``count`` says it counts them itself (False: the stack counts them, Accelerate and DeepSpeed)."""
    counting = facts.accumulates and count
    head = "for i, batch in enumerate(loader, start=1):" if counting else "for batch in loader:"
    return head + loader_comment(facts)


def accumulate_lines(facts: Facts, indent_by: int = 4) -> list[str]:
    """After a micro-batch's backward: on to the next micro-batch unless it completes an optimizer
    step (nothing without accumulation)."""
    if not facts.accumulates:
        return []
    k = facts.accumulation_steps
    return indent(
        ["if i % accumulation_steps:", f"    continue  # the optimizer steps once every {k} micro-batches"],
        indent_by,
    )


def loop_helper_names(facts: Facts) -> list[str]:
    """The snippets :func:`loss_lines` and the loss scaling need."""
    names = ["default_dtype"] if facts.true is not None else []
    if facts.true == torch.float16:
        names.append("HalfGradScaler")
    return names
