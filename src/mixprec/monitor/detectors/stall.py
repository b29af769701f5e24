"""Half-precision weight updates that round away (``stall``): more than
:data:`~mixprec.monitor.judge.STALL_LIMIT` of them at a sampled step, or predicted to pass it. The
half weights cannot hold an update below half an ulp; fp32 master weights can: rescued by the
*-mixed twin of a *-true policy, or the half weights widened to fp32 in place."""

from __future__ import annotations

from mixprec.monitor.detectors.base import Detector, Run, SampleView
from mixprec.monitor.findings import STALL, MonitorFinding
from mixprec.monitor.judge import STALL_LIMIT, stall


class Stall(Detector):
    """The stalled share the sampler counted right after each sampled optimizer step."""

    kinds = (STALL,)

    def on_sample(self, run: Run, view: SampleView) -> bool:
        if view.explained:
            return False
        seen = stall(run.sampler.stalls, run.every)
        if seen is None:
            return False
        when = (
            f", predicted to pass {STALL_LIMIT:.0%} at about step {seen.predicted_step}"
            if seen.predicted_step is not None
            else ""
        )
        message = (
            f"{seen.fraction:.1%} of the weight updates rounded away at this step{when}: the half "
            "weights cannot hold them; fp32 master weights can (the *-mixed policy, live with rescue=True)"
        )
        finding = MonitorFinding(view.step, STALL, message, None, {"stalled_fraction": seen.fraction})
        run.report(finding, run.rescuer.action("master_weights"))
        return False
