"""What `autotune` returns: the pick it measured, whole (policy, layout, islands, compile mode and
scope, optimizer implementation, micro-batch), and how a training loop applies each part of it, as
mixprec's own training session did when it measured it.

    tuned = mixprec.autotune(workload)
    model = tuned.prepare(model)                    # casts, channels_last, islands; compiled if measured so
    optimizer = tuned.optimizer(make_optimizer(model))  # its measured implementation (foreach, fused)
    step = tuned.compile_step(train_step)           # the whole step compiled, where that was the pick
    for micro_batches in chunks(loader, tuned.accumulation_steps):  # tuned.micro_batch samples each
        ...                                          # tuned.policy.autocast(), backward, step
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import nn

from mixprec.frameworks.torch.session import with_implementation
from mixprec.policy import Candidate, Policy

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Tuned:
    """The candidate `autotune` picked and its torch Policy.

    Attributes:
        candidate: the pick as measured (:class:`mixprec.Candidate`).
        policy: ``get_policy(candidate)``: autocast, loss scaling, precision scope.
        reason: why it was picked (tune's words).
    """

    candidate: Candidate
    policy: Policy
    reason: str = ""

    @property
    def micro_batch(self) -> int | None:
        """Samples per forward/backward pass where the pick runs its own (``batch="auto"``), else None:
        the batch size tuned with."""
        return self.candidate.micro_batch

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (gradient accumulation, each loss divided by it)."""
        return self.candidate.accumulation_steps

    def prepare(self, model: nn.Module) -> nn.Module:
        """``policy.prepare(model)`` (device, casts, channels_last, fp32 islands), then
        ``torch.compile(model, mode=...)`` where the pick compiles the model (after the casts, as it
        was measured). A pick that compiles the whole step leaves that to :meth:`compile_step`."""
        model = self.policy.prepare(model)
        cand = self.candidate
        if cand.compile and cand.compile_scope is None:
            return cast(nn.Module, torch.compile(model, mode=cand.compile))
        return model

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The same optimizer (class, hyperparameters, groups) with the measured implementation
        ('for-loop', 'foreach' or 'fused'); ``optimizer`` itself where the pick names none. Call it
        before the first step."""
        if self.candidate.optimizer is None:
            return optimizer
        return with_implementation(optimizer, self.candidate.optimizer)

    def compile_step(self, train_step: F) -> F:
        """``torch.compile(train_step, mode=...)`` where the pick compiles the whole step (forward,
        loss, backward and optimizer step in one function), else ``train_step`` unchanged."""
        cand = self.candidate
        if cand.compile and cand.compile_scope == "step":
            return cast(F, torch.compile(train_step, mode=cand.compile))
        return train_step
