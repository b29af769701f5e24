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
        # Whatever steps the script's optimizer is what the monitor reads skips and the loss scale
        # from: the candidate's Policy where it routes the steps, else the script's own enabled
        # GradScaler (its shadow replays still run under the candidate's autocast). Handing the
        # monitor a Policy the loop never steps is the `unwatched` mistake it reports.
        own = next((s for s in agent.script_scalers if s.is_enabled()), None)
        policy = agent.policy if agent.policy is not None and (agent.routing or own is None) else None
        self.monitor = Monitor(
            agent.model,
            policy,
            optimizer=agent.optimizers,
            scaler=None if policy is not None else own,
            autocast=agent.policy.autocast if agent.policy is not None and policy is None else None,
            config=self.config,
            findings=self.findings,
        )

    def forward(self, agent: Any, args: tuple, kwargs: dict) -> None:
        """The model's inputs of a training forward (what a shadow replays)."""

    def before_update(self, agent: Any) -> None:
        """The lead optimizer is about to apply the step's update."""

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
