"""The monitor's sampled steps: which steps are sampled, what a sampled step records (per-layer
ranges on the real step, the share of half-precision weight updates that rounded away) and what
sampling costs.

A sampled step hooks every layer of the model and fits a trend afterwards; on a launch-bound model
that can cost more than a whole step. With ``every=None`` (the default) the sampler keeps that
cost under :data:`BUDGET` of the run's time: it times the steps between samples (the host's time
between two :meth:`Sampler.tick` calls, which on a GPU is the step time once the queue is full) and
the sampled ones, and when two samples in a row cost more than the budget allows at the current
interval it widens the interval to the smallest multiple of it that fits the budget (within the
run's least number of samples), keeping only the samples already taken on the new grid, so the
series stay evenly spaced and the trends fitted on them mean what they did. The interval only
grows: a monitor never flaps between two rates. An ``every`` the user gives is kept as it is.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any

import torch
from torch import nn

from mixprec.frameworks.torch.ranges import StepRecorder
from mixprec.numerics.trend import LayerSeries
from mixprec.policy.scaler import rounded_away

EVERY = 100  # the most often a step is sampled by default
# The share of the run's time sampled steps may cost (the per-step work, ~5 us on a CPU, is apart).
BUDGET = 0.0015
MAX_WIDENING = 64  # an automatic interval stays within 64x EVERY: a run is still sampled
# A run whose length is known is sampled at least this often: the trend rules fit a line through
# the samples (a 300-step run sampled every 400 steps had one sample and no trend at all).
MIN_SAMPLES = 8
_RECENT_STEPS = 16  # unsampled step times the typical step time is the median of


class Sampler:
    """Samples one model's steps; :meth:`begin` hooks the next step when it is due, :meth:`end`
    records it. ``every``: a fixed interval, or None for :data:`EVERY` widened to the budget.
    ``run_steps``: the run's length where known: an automatic interval then gives it at least
    :data:`MIN_SAMPLES` samples, whatever the budget."""

    def __init__(
        self,
        model: nn.Module,
        range_format: str | None,
        every: int | None,
        run_steps: int | None = None,
        *,
        updates_hooked: bool = False,
    ) -> None:
        self.model = model
        # whether the optimizer's post-step hook calls count_stalls (the monitor holds the
        # optimizer): then a sampled step is counted at its update and never without one
        self.updates_hooked = updates_hooked
        self.fixed = every is not None
        self.most = MAX_WIDENING * EVERY  # the widest automatic interval
        if run_steps:
            self.most = max(1, run_steps // MIN_SAMPLES)
        self.interval = every if every is not None else min(EVERY, self.most)
        self.recorder = StepRecorder(model, underflow_format=range_format)
        self.steps: list[int] = []  # the step of each recorded sample, aligned with the series
        self.stalls: list[tuple[int, float]] = []  # (step, share of updates that rounded away)
        # half-precision weights (a *-true policy, or a model trained in bf16 by its framework):
        # their updates can round away
        self.half_weights = any(
            p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters() if p.requires_grad
        )
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._mark: float | None = None
        self._typical: deque[float] = deque(maxlen=_RECENT_STEPS)
        self._over_budget = 0  # samples in a row that cost more than the budget allows

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    # ------------------------------------------------------------------ one sampled step
    def begin(self, step: int, now: float | None = None) -> None:
        """Hook the model for ``step`` when it is due (called at the end of the step before); the
        step's time is counted from ``now`` (the hooks' own cost included)."""
        self._mark = time.perf_counter() if now is None else now
        if step % self.interval:
            return
        self.recorder.begin()
        if self.half_weights:
            self._before = [(p, p.detach().clone()) for p in self.model.parameters() if p.requires_grad]

    def end(self, step: int, loss_scale: float | None, skipped: bool) -> None:
        """Record the sampled ``step`` (its gradients unscaled by ``loss_scale``)."""
        self.recorder.end(loss_scale)
        self.steps.append(step)
        if skipped:
            self._before = []  # a skipped step moved nothing: no stall to count
        if not self.updates_hooked:
            self.count_stalls(step)  # (no optimizer hook: the step is taken to have updated)
        # else the update counts it: a micro-batch of gradient accumulation (the loop observes every
        # one) does not step the optimizer, moves nothing and stalls nothing; its snapshot waits
        # for the optimizer step that ends the accumulation

    @property
    def awaits_update(self) -> bool:
        """Whether a sampled step's stalls wait to be counted at the next update."""
        return bool(self._before)

    def count_stalls(self, step: int) -> None:
        """The share of weights with a gradient that the update left bit-identical (*-true); run
        right after the optimizer step (its post-step hook), while the gradients are still there
        (the HF Trainer zeroes them before its callbacks run)."""
        if not self._before:
            return
        stalled, total = rounded_away(self._before)
        self._before = []
        if total:
            self.stalls.append((step, stalled / total))

    def discard_stalls(self) -> None:
        """The sampled step's update did not happen (withheld): nothing to count."""
        self._before = []

    def abandon(self) -> None:
        self.recorder.abandon()
        self._before = []

    # ------------------------------------------------------------------ cost
    def untimed_until(self, step: int) -> int:
        """The first step from ``step`` on that the sampler must see (:meth:`next` at its end): the
        steps before it are neither sampled nor timed, since the typical step the budget compares a
        sample with is timed over the :data:`_RECENT_STEPS` steps right before it (and a fixed
        interval needs no time at all). A caller may skip :meth:`next` for them (the monitor's
        per-step work on a launch-bound step is microseconds that count); the first tick after
        such a stretch has no start and is not taken."""
        due = -(-step // self.interval) * self.interval  # the next sampled step (``step`` where it is)
        # (the step before a sampled one begins it; a fixed interval times nothing)
        first = max(step, due - 1 if self.fixed else due - _RECENT_STEPS - 1)
        if first > step:
            self._mark = None
        return first

    def next(self, step: int) -> None:
        """The step before ``step`` ended: time it, then :meth:`begin` ``step``."""
        now = time.perf_counter()
        if self._mark is not None:
            self.tick(step - 1, now - self._mark)
        self.begin(step, now)

    def tick(self, step: int, seconds: float) -> None:
        """``step`` took ``seconds``; after a sampled step, widen the interval if sampling costs
        more than the budget."""
        if step % self.interval:
            self._typical.append(seconds)
            return
        if self.fixed or len(self._typical) < _RECENT_STEPS // 2:
            return
        typical = statistics.median(self._typical)
        extra = seconds - typical
        needed = extra / (BUDGET * typical) if typical > 0 else 0.0
        self._over_budget = self._over_budget + 1 if needed > self.interval else 0
        if self._over_budget >= 2 and self.interval * 2 <= self.most:
            # a multiple of the interval, so the grid holds: the smallest within the budget (a
            # power of two overshot it by up to 2x, or fell to half the run's widest interval)
            factor = min(math.ceil(needed / self.interval * (1 - 1e-9)), self.most // self.interval)
            self._widen(self.interval * factor)
            self._over_budget = 0

    def _widen(self, interval: int) -> None:
        """Sample every ``interval`` steps from now on; the samples taken off that grid go."""
        keep = [i for i, s in enumerate(self.steps) if s % interval == 0]
        for series in self.recorder.series.values():
            series.forward = [series.forward[i] for i in keep]
            series.backward = [series.backward[i] for i in keep if i < len(series.backward)]
            series.underflow = [series.underflow[i] for i in keep if i < len(series.underflow)]
        self.steps = [self.steps[i] for i in keep]
        self.recorder.steps = len(self.steps)
        self.stalls = [(s, v) for s, v in self.stalls if s % interval == 0]
        self.interval = interval

    # ------------------------------------------------------------------ what the trends read
    def window(self, size: int) -> tuple[list[LayerSeries], int]:
        """The latest ``size`` samples of every series and the step of the first of them."""
        offset = max(0, len(self.steps) - size)
        first = self.steps[offset] if self.steps else 0
        series = [
            LayerSeries(s.name, s.type, s.forward[offset:], s.backward[offset:], s.underflow[offset:])
            for s in self.recorder.series.values()
        ]
        return series, first

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        return {
            "interval": self.interval,
            "sample_steps": list(self.steps),
            "stalls": [list(s) for s in self.stalls],
            "series": [s.to_dict() for s in self.recorder.series.values()],
            "recorded": self.recorder.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.abandon()
        if not self.fixed:
            self.interval = int(state.get("interval", self.interval))
        self.steps = [int(s) for s in state.get("sample_steps") or []]
        self.stalls = [(int(s), float(v)) for s, v in state.get("stalls") or []]
        self.recorder.series = {d["name"]: LayerSeries.from_dict(d) for d in state.get("series") or []}
        self.recorder.steps = int(state.get("recorded", 0))
