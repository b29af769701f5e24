"""What the loss scaler did at each step: whether the step was skipped, the scale it left, and
the level the run settled at after GradScaler's start-up (a skip below it is news; a back-off to
it after a growth is GradScaler's normal rhythm)."""

from __future__ import annotations

from typing import Any

import torch

from mixprec.policy import Policy
from mixprec.policy.scaler import MAX_CONSECUTIVE_SKIPS

# GradScaler's start-up: from its initial 65536 it backs off until the gradients fit, which a model
# may need a few steps into the run to show (a ViT in fp16 skipped its third step). The scale it
# settles at is the one it holds after this many steps; a skip before is its search, not news.
STARTUP_STEPS = 50


class ScaleWatch:
    """The scaler of a Policy, or of a plain ``torch.amp`` loop (``scaler``); neither: no scale.

    Attributes:
        skipped: the steps that were skipped.
        scales: ``(step, scale)`` where the scale was read.
        settled: the scale after GradScaler's start-up (it follows the scale through the first
            :data:`STARTUP_STEPS` steps; None until the first step that moved).
        current: the scale the last step left (the next step's).
        skips_seen: the policy's skipped steps as of the last step observed (a step that changes
            them was skipped).
    """

    def __init__(self, policy: Policy | None, scaler: torch.amp.GradScaler | None) -> None:
        self.policy, self.scaler = policy, scaler
        self.skipped: list[int] = []
        self.scales: list[tuple[int, float]] = []
        self.settled: float | None = None
        self.skips_seen = policy.stats.skipped_steps if policy is not None else 0
        self.current = self.read()

    def read(self) -> float | None:
        if self.policy is not None:
            return self.policy.stats.scale
        if self.scaler is not None and self.scaler.is_enabled():
            return float(self.scaler.get_scale())  # its initial scale before the first step
        return None

    def after_step(self, step: int, sampled: bool) -> bool:
        """Whether ``step`` was skipped. A policy counts its skips on the host; its scale (a device
        tensor) is read only when it matters: after a skip, until the scale settles, at sampled
        steps. A plain loop's skip shows as a lower scale, read from GradScaler after its
        ``step()`` has already synchronised (non-fused optimizers)."""
        if self.policy is not None:
            skipped = self.policy.stats.skipped_steps > self.skips_seen
            self.skips_seen = self.policy.stats.skipped_steps
            if self.policy.scaler is None or not (skipped or self.settled is None or sampled):
                self._note(step, skipped)
                return skipped
            scale = self.policy.stats.scale
        else:
            scale = self.read()
            skipped = scale is not None and self.current is not None and scale < self.current
        if scale is not None:
            self.scales.append((step, scale))
        self.current = scale
        self._note(step, skipped)
        return skipped

    def starting(self, step: int) -> bool:
        """Whether ``step`` is in GradScaler's start-up, where a skip is its search for the scale."""
        return step < STARTUP_STEPS

    def unscaled(self) -> bool:
        """Whether the run's skips are a finite check's (a Policy with ``finite_check`` and no loss
        scaler, bf16-mixed say): no scale, so no scaler's rhythm."""
        return self.policy is not None and self.policy.scaler is None

    def news(self, step: int) -> bool:
        """Whether the skip of ``step`` is news: a finite check's skip always is (no scaler backs off
        and searches: the gradients were not finite, and the fp32 shadow says whose fault that is);
        a loss scaler's, past the start-up and with the scale below the level the run settled at (a
        back-off to that level after a growth is GradScaler's normal rhythm)."""
        if self.unscaled():
            return True
        if self.settled is None or self.current is None or self.starting(step):
            return False
        return self.current < self.settled

    def gives_up_next(self) -> bool:
        """Whether one more skip makes the policy raise its own error, which blames the precision:
        ``ScaleCollapseError`` with the scale at its ``min_scale`` floor
        (``max_skips_at_min_scale`` skips there), ``NonFiniteGradientsError`` after
        ``MAX_CONSECUTIVE_SKIPS`` skips in a row under a finite check. A plain GradScaler never
        gives up."""
        if self.policy is None:
            return False
        stats = self.policy.stats
        if self.unscaled():
            return self.policy.config.finite_check and stats.consecutive_skips + 1 >= MAX_CONSECUTIVE_SKIPS
        options = self.policy.config.scaler
        if options is None or options.min_scale is None or self.current is None:
            return False
        at_floor = self.current <= options.min_scale
        return at_floor and stats.skips_at_min_scale + 1 >= options.max_skips_at_min_scale

    def _note(self, step: int, skipped: bool) -> None:
        if skipped:
            self.skipped.append(step)
        elif self.settled is None or self.starting(step):
            self.settled = self.current  # the level GradScaler's start-up found

    def state_dict(self) -> dict[str, Any]:
        return {"settled_scale": self.settled, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.settled = state.get("settled_scale")
        self.skipped = [int(v) for v in state.get("skipped") or []]
        self.skips_seen = self.policy.stats.skipped_steps if self.policy is not None else 0
        self.current = self.read()
