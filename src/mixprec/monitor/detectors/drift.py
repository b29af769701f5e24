"""Numerical drift (``drift``): every ``shadow_every`` steps a shadow step, forward and backward in
the policy and in strict fp32 on the same batch (the run restored after); the gradient SQNR against
the first shadow's (this policy's noise floor on this model) falling :data:`DRIFT_DB` is drift. An
alert: nothing is rescued."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.detectors.base import Detector, Run, StepView
from mixprec.monitor.findings import DRIFT, MonitorFinding
from mixprec.monitor.shadow import shadow_sqnr

log = logging.getLogger("mixprec.monitor")

DRIFT_DB = 20.0


class Drift(Detector):
    """The shadow steps' gradient SQNR against the first one's."""

    kinds = (DRIFT,)

    def __init__(self, config: MonitorConfig) -> None:
        super().__init__(config)
        self.start_db: float | None = None  # the SQNR of the first shadow step

    def on_step(self, run: Run, view: StepView) -> bool:
        every = self.config.shadow_every
        if not every or view.step % every or view.batch is None:
            return False
        assert run.loss_fn is not None  # (a view has a batch only where there is one)
        autocast = run.policy.autocast if run.policy is not None else None
        try:
            sqnr = shadow_sqnr(run.model, run.loss_fn, view.batch, autocast, run.scale.current)
        except Exception as exc:  # evidence only: its failure must not stop the run
            log.debug("shadow step failed: %s", exc)
            return False
        if sqnr is None:
            return False
        if self.start_db is None:
            self.start_db = sqnr
        elif sqnr < self.start_db - DRIFT_DB:
            message = (
                f"gradient SQNR against the fp32 shadow fell to {sqnr:.1f} dB "
                f"(start-up: {self.start_db:.1f} dB)"
            )
            run.report(MonitorFinding(view.step, DRIFT, message, None, {"grad_sqnr_db": sqnr}))
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"shadow_db": self.start_db}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.start_db = state.get("shadow_db")
