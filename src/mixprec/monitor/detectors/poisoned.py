"""Poisoned weights: inf/NaN in the weights or the optimizer state (``nonfinite_weights``).

Looked for first on a suspect step (before a batch or the precision is blamed for what the weights
did) and at every sampled step; the non-finite losses that follow are its consequence, so it
explains the step. Rescued by a roll-back to the last snapshot (``snapshot_every``), never to one
that was itself poisoned.
"""

from __future__ import annotations

from mixprec.monitor.detectors.base import Detector, Run, SampleView, StepView
from mixprec.monitor.findings import NONFINITE_WEIGHTS, MonitorFinding
from mixprec.monitor.rescue import module_of, nonfinite_state


class PoisonedWeights(Detector):
    """Weights or optimizer state holding inf/NaN: one sum per tensor, element-wise only where a
    sum is not finite (:func:`~mixprec.monitor.rescue.nonfinite_state`)."""

    kinds = (NONFINITE_WEIGHTS,)

    def on_suspect(self, run: Run, view: StepView) -> bool:
        if view.batch is None:
            return False
        return self._found(run, view.step)

    def on_sample(self, run: Run, view: SampleView) -> bool:
        return self._found(run, view.step)

    def _found(self, run: Run, step: int) -> bool:
        bad = nonfinite_state(run.model, run.optimizers)
        if bad is None:
            return False
        finding = MonitorFinding(step, NONFINITE_WEIGHTS, f"{bad} holds inf/NaN", module_of(bad))
        run.report(finding, run.rescuer.roll_back)
        return True
