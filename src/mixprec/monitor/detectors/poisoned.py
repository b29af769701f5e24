"""Poisoned weights: inf/NaN in the weights or the optimizer state (``nonfinite_weights``).

Looked for first on a suspect step (before a batch or the precision is blamed for what the weights
did) and at every sampled step; the non-finite losses that follow are its consequence, so it
explains the step. Rescued by a roll-back to the last snapshot (``snapshot_every``), never to one
that was itself poisoned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

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
        return self._found(run, view.step, view.batch)

    def on_sample(self, run: Run, view: SampleView) -> bool:
        return self._found(run, view.step)

    def _found(self, run: Run, step: int, batch: Any = None) -> bool:
        bad = nonfinite_state(run.model, run.optimizers)
        if bad is None:
            return False
        message = f"{bad} holds inf/NaN"
        evidence: dict[str, Any] = {}
        if holds_nonfinite(batch):  # (the step's batch, scanned only now that the weights broke)
            message += (
                ": this step's batch holds inf/NaN, and an update without a finite check (strict fp32, "
                "bf16) applied it; the data, not the precision (a finite check, or a loss scaler, "
                "would have skipped it)"
            )
            evidence["batch_nonfinite"] = True
        finding = MonitorFinding(step, NONFINITE_WEIGHTS, message, module_of(bad), evidence)
        run.report(finding, run.rescuer.action("roll_back"))
        return True


def holds_nonfinite(batch: Any) -> bool:
    """Whether a floating tensor anywhere in ``batch`` (tensors, mappings, sequences) holds inf/NaN."""
    if isinstance(batch, torch.Tensor):
        return batch.is_floating_point() and not bool(torch.isfinite(batch).all())
    if isinstance(batch, Mapping):
        return any(holds_nonfinite(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return any(holds_nonfinite(v) for v in batch)
    return False
