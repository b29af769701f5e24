"""The data, not the precision (``bad_batch``): on a suspect step, the same batch through the same
weights in strict fp32, forward only. Not finite there too, or :data:`SPIKE_MADS` median absolute
deviations above the recent losses: the batch is to blame, nothing is rescued and the precision is
not blamed.

Only skipped steps and non-finite losses are shadowed: a finite spike on a step that moved the
weights cannot be, since the weights that made it are gone (an earlier version shadowed every
finite spike and blamed about 50 batches of an unstable ResNet-50 run, wrongly).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence

from mixprec.monitor.detectors.base import Detector, Run, StepView
from mixprec.monitor.findings import BAD_BATCH, MonitorFinding
from mixprec.monitor.shadow import fp32_loss

log = logging.getLogger("mixprec.monitor")

SPIKE_MADS = 10.0  # a loss this many median absolute deviations above the recent median is a spike
RECENT = 50  # losses the spike test compares with


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
        skipped = "the step was skipped, " if view.skipped else ""
        shows = "spikes too" if math.isfinite(shadow) else "is not finite"
        message = (
            f"the fp32 shadow of this batch {shows} (loss {shadow:.4g}): the data, not the precision; "
            f"{skipped}the policy is not blamed"
        )
        evidence = {"fp32_loss": shadow, "recent_median": statistics.median(recent) if recent else None}
        run.report(MonitorFinding(view.step, BAD_BATCH, message, None, evidence))
        return True
