"""A layer whose range trend crosses the policy's format within the run (``predicted_overflow``,
``underflow``): the fits of :mod:`mixprec.numerics.trend` on the latest samples
(:func:`mixprec.monitor.judge.range_risk`), found before the overflow happens. Rescued by an fp32
island for the layer.

A format with fp32's exponent range (bf16) overflows where fp32 does: a layer predicted to overflow
it is predicted to overflow strict fp32 too, so the run diverges whatever the precision
(``divergence``): the format is not blamed, and no fp32 island is added (it would not help)."""

from __future__ import annotations

from mixprec.monitor.detectors.base import Detector, Run, SampleView
from mixprec.monitor.findings import DIVERGENCE, PREDICTED_OVERFLOW, UNDERFLOW, MonitorFinding
from mixprec.monitor.judge import WINDOW, has_fp32_range, range_risk
from mixprec.policy.islands import is_fp32_island


class PredictedRange(Detector):
    """The earliest crossing the evidence supports, at each sampled step of a low-precision run."""

    kinds = (PREDICTED_OVERFLOW, UNDERFLOW, DIVERGENCE)

    def on_sample(self, run: Run, view: SampleView) -> bool:
        if view.explained or run.range_format is None:
            return False
        window, first = run.sampler.window(WINDOW)
        # an fp32 island's own ranges are fp32's: they cannot overflow the policy's format
        window = [s for s in window if not is_fp32_island(s.name, view.islands)]
        risk = range_risk(window, first, run.every, run.range_format, run.config.train_steps)
        if risk is None:
            return False
        evidence = {"predicted_step": risk.step, "headroom_bits": risk.headroom_bits}
        layer = risk.layer
        if risk.direction != "underflow" and has_fp32_range(run.range_format):
            message = (
                f"{risk.message}: {run.range_format} has fp32's exponent range, so strict fp32 overflows "
                "there too: the run diverges whatever the precision, and an fp32 island would not help "
                "(lower the learning rate, clip the gradients, or look at the objective)"
            )
            run.report(MonitorFinding(view.step, DIVERGENCE, message, layer, evidence))
            return False
        kind = UNDERFLOW if risk.direction == "underflow" else PREDICTED_OVERFLOW
        finding = MonitorFinding(view.step, kind, risk.message, layer, evidence)
        run.report(finding, run.rescuer.action("island", layer))
        return False
