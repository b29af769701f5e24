"""A layer whose range trend crosses the policy's format within the run (``predicted_overflow``,
``underflow``): the fits of :mod:`mixprec.numerics.trend` on the latest samples
(:func:`mixprec.monitor.judge.range_risk`), found before the overflow happens. Rescued by an fp32
island for the layer."""

from __future__ import annotations

from mixprec.monitor.detectors.base import Detector, Run, SampleView
from mixprec.monitor.findings import PREDICTED_OVERFLOW, UNDERFLOW, MonitorFinding
from mixprec.monitor.judge import WINDOW, range_risk
from mixprec.policy.islands import is_fp32_island


class PredictedRange(Detector):
    """The earliest crossing the evidence supports, at each sampled step of a low-precision run."""

    kinds = (PREDICTED_OVERFLOW, UNDERFLOW)

    def on_sample(self, run: Run, view: SampleView) -> bool:
        if view.explained or run.range_format is None:
            return False
        window, first = run.sampler.window(WINDOW)
        # an fp32 island's own ranges are fp32's: they cannot overflow the policy's format
        window = [s for s in window if not is_fp32_island(s.name, view.islands)]
        risk = range_risk(window, first, run.every, run.range_format, run.config.train_steps)
        if risk is None:
            return False
        kind = UNDERFLOW if risk.direction == "underflow" else PREDICTED_OVERFLOW
        evidence = {"predicted_step": risk.step, "headroom_bits": risk.headroom_bits}
        layer = risk.layer
        run.report(
            MonitorFinding(view.step, kind, risk.message, layer, evidence), lambda: run.rescuer.island(layer)
        )
        return False
