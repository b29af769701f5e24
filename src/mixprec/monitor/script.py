"""The monitor inside a training script run by ``mixprec run --monitor -- python train.py``: an
observer the script's agent (:mod:`mixprec.frameworks.script.agent`) calls once the model is found
and at every optimizer step, with the step's loss (on the device: read at sampled steps only).
Findings go to ``events.jsonl``; the run's record (``run.json``) gets the losses, findings and
health; a monitor that gives up on the run stops it (exit 4)."""

from __future__ import annotations

from typing import Any

import torch

from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.core import Monitor


class ScriptMonitor:
    """A :class:`~mixprec.monitor.Monitor` over the script's model, policy and optimizers."""

    def __init__(self, agent: Any, settings: dict[str, Any]) -> None:
        settings = dict(settings)
        self.findings = settings.pop("findings", None)
        self.config = MonitorConfig(**settings)
        self.monitor: Monitor | None = None

    def discovered(self, agent: Any) -> None:
        # a plain loop's own GradScaler (where the policy does not scale: its scaler is the script's)
        scaler = None if agent.policy is not None else next(iter(agent.script_scalers), None)
        self.monitor = Monitor(
            agent.model,
            agent.policy,
            optimizer=agent.optimizers,
            scaler=scaler,
            config=self.config,
            findings=self.findings,
        )

    def step(self, agent: Any, loss: torch.Tensor | None, skipped: bool) -> str | None:
        """Record the step; what stopped the run, if the monitor gave up on it."""
        if self.monitor is None or loss is None:
            return None
        self.monitor.record(loss)
        return f"the monitor stopped the run: {self.monitor.stopped}" if self.monitor.stopped else None

    def summary(self) -> dict[str, Any]:
        if self.monitor is None:
            return {}
        self.monitor.close()
        return {
            "losses": list(self.monitor.losses),
            "findings": [f.to_dict() for f in self.monitor.findings],
            "healthy": self.monitor.healthy,
        }


def attach(agent: Any, settings: dict[str, Any]) -> ScriptMonitor:
    """The observer ``mixprec run --monitor`` names in the agent's plan."""
    return ScriptMonitor(agent, settings)
