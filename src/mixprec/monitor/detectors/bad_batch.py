"""The data, not the precision (``bad_batch``): on a suspect step, the same batch through the same
weights in strict fp32, forward only. Not finite there too, or :data:`SPIKE_MADS` median absolute
deviations above the recent losses: the batch is to blame, nothing is rescued and the precision is
not blamed.

Only skipped steps and non-finite losses are shadowed: a finite spike on a step that moved the
weights cannot be, since the weights that made it are gone (an earlier version shadowed every
finite spike and blamed about 50 batches of an unstable ResNet-50 run, wrongly).

Bad batches in a row are a broken data pipeline: after :data:`DATA_STREAK` of them, or where the
next skip would make the policy give up with its own error (an fp16 loss scale at its floor raises
``ScaleCollapseError``, which names the precision), the run is stopped with the data as its reason,
whatever ``rescue`` says: no precision answers it (:class:`InARow`; the spike detector's ``data``
verdicts, whose updates are withheld, count the same way).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.detectors.base import Detector, Run, StepView
from mixprec.monitor.findings import BAD_BATCH, DIVERGENCE, MonitorFinding
from mixprec.monitor.shadow import control_fails, fp32_loss

log = logging.getLogger("mixprec.monitor")

SPIKE_MADS = 10.0  # a loss this many median absolute deviations above the recent median is a spike
RECENT = 50  # losses the spike test compares with
DATA_STREAK = 8  # bad batches in a row: the data pipeline, not a bad record
DIVERGED_WHY = (
    "the weights fail on every batch, in strict fp32 too: the run diverges, and no precision rescues it "
    "nor is a batch to blame; lower the learning rate (or clip the gradients), or fix the objective, and "
    "start again from a finite checkpoint"
)


class InARow:
    """The latest bad batches in a row (their first and last step), to stop a run whose data
    pipeline broke (:meth:`stop_if_broken`)."""

    def __init__(self) -> None:
        self.since, self.last = -1, -2

    def stop_if_broken(self, run: Run, finding: MonitorFinding, *, skipped: bool, why: str = "") -> None:
        """Count ``finding`` (a bad batch at its step) and stop the run on a broken pipeline:
        :data:`DATA_STREAK` bad batches in a row, or fewer where the policy's own guard would stop
        it at the next skip, blaming the precision (an fp16 run whose every batch is NaN halves its
        loss scale each step, to the floor). ``why``: the cause to stop with, where it is not the
        data (weights that fail on every batch)."""
        if finding.step != self.last + 1:
            self.since = finding.step
        self.last = finding.step
        count = finding.step - self.since + 1
        guard = skipped and run.scale.gives_up_next()
        if count < DATA_STREAK and not guard:
            return
        if why:
            run.stop(finding, f"on {count} steps in a row (steps {self.since}..{finding.step}): {why}")
            return
        gives_up = (
            "the policy's finite check gives up (NonFiniteGradientsError)"
            if run.scale.unscaled()
            else "the policy's loss scale collapses (ScaleCollapseError)"
        )
        run.stop(
            finding,
            f"on {count} batches in a row (steps {self.since}..{finding.step}): the data pipeline is "
            f"broken, not the precision, and no precision rescues it; the run is stopped before "
            f"{gives_up if guard else 'it trains on nothing but bad batches'}; fix the data (the first "
            f"bad batch is step {self.since})",
        )

    def state_dict(self) -> list[int]:
        return [self.since, self.last]

    def load_state_dict(self, state: Sequence[int] | None) -> None:
        self.since, self.last = (int(v) for v in state) if state else (-1, -2)


def spikes(value: float, recent: Sequence[float]) -> bool:
    """``value`` is not finite, or :data:`SPIKE_MADS` median absolute deviations above the median."""
    if not math.isfinite(value):
        return True
    median = statistics.median(recent)
    mad = statistics.median(abs(v - median) for v in recent) or abs(median) * 1e-3 or 1e-12
    return value > median + SPIKE_MADS * mad


class BadBatch(Detector):
    """The fp32 shadow of a suspect step's batch."""

    kinds = (BAD_BATCH,)

    def __init__(self, config: MonitorConfig) -> None:
        super().__init__(config)
        self.in_a_row = InARow()
        self.diverged_in_a_row = InARow()

    def on_suspect(self, run: Run, view: StepView) -> bool:
        if view.batch is None:
            return False
        assert run.loss_fn is not None  # (a view has a batch only where there is one)
        try:
            shadow = fp32_loss(run.model, run.loss_fn, view.batch)
        except Exception as exc:  # the shadow is evidence; its failure must not stop the run
            log.debug("fp32 shadow failed: %s", exc)
            return False
        recent = [v for v in run.read_losses()[-RECENT - 1 : -1] if math.isfinite(v)]
        spike = len(recent) >= 5 and spikes(shadow, recent)
        if math.isfinite(shadow) and not spike:
            return False
        judge = (lambda v: spikes(v, recent)) if len(recent) >= 5 else (lambda v: not math.isfinite(v))
        control = control_fails(run.model, run.loss_fn, run.control_batch, view.batch, judge)
        if control is not None:  # the weights fail on a normal batch too: not this batch's fault
            message = (
                f"the fp32 shadow of this batch is {shadow:.4g}, and of a batch whose loss was normal "
                f"{control:.4g}: the weights fail on any batch, in strict fp32 too"
            )
            seen = {"fp32_loss": shadow, "control_fp32_loss": control}
            finding = MonitorFinding(view.step, DIVERGENCE, message, None, seen)
            run.report(finding, dedupe=False)
            self.diverged_in_a_row.stop_if_broken(run, finding, skipped=view.skipped, why=DIVERGED_WHY)
            return True
        skipped = "the step was skipped, " if view.skipped else ""
        shows = "spikes too" if math.isfinite(shadow) else "is not finite"
        message = (
            f"the fp32 shadow of this batch {shows} (loss {shadow:.4g}): the data, not the precision; "
            f"{skipped}the policy is not blamed"
        )
        evidence = {"fp32_loss": shadow, "recent_median": statistics.median(recent) if recent else None}
        finding = MonitorFinding(view.step, BAD_BATCH, message, None, evidence)
        run.report(finding)
        self.in_a_row.stop_if_broken(run, finding, skipped=view.skipped)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"bad_batches_in_a_row": self.in_a_row.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.in_a_row.load_state_dict(state.get("bad_batches_in_a_row"))
