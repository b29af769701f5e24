"""`mixprec train`'s loop: a workload trained ``steps`` steps under a policy with the monitor, the
long-run ground truth a user can get in one command (and the way to try a rescue)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import UsageError
from mixprec.monitor.core import Monitor, MonitorStop
from mixprec.policy import get_policy
from mixprec.workload import Workload


@dataclass
class TrainResult:
    """What a monitored run did, step by step.

    Attributes:
        policy / final_policy: the policy it started with, and the one it ended with (after any
            rescue: the policy for the next run, with its keep_fp32 islands).
        losses / scales / skipped: per step (scales where the policy has a scaler).
        findings: the monitor's findings (``Finding.to_dict()``).
        series: per-layer ranges at the sampled steps (``LayerSeries.to_dict()``), taken at
            ``sample_steps``; ``every``: the interval they ended at (the user's, or the automatic
            one after any widening).
        healthy: no finding that blames the precision was left unanswered and the loss is finite.
        stopped: why the run stopped early ('' when it ran all its steps).
    """

    workload: str
    policy: str
    final_policy: dict[str, Any]
    steps: int
    every: int
    sample_steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    scales: list[tuple[int, float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    series: list[dict[str, Any]] = field(default_factory=list)
    range_format: str | None = None
    healthy: bool = True
    stopped: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dict(vars(self))
        data["losses"] = [v if math.isfinite(v) else str(v) for v in self.losses]
        return data


def train(
    workload: Workload,
    policy: str,
    steps: int,
    *,
    device: str = "cpu",
    batch_size: int | None = None,
    rescue: bool = False,
    every: int | None = None,
    shadow_every: int = 0,
    events: str | Path | None = None,
    seed: int = 0,
) -> TrainResult:
    """Train ``workload`` for ``steps`` steps under ``policy`` with a :class:`Monitor`; a
    :class:`MonitorStop` ends the run early (``stopped``), what was measured is kept."""
    if not isinstance(workload, Workload):
        raise UsageError(
            f"mixprec train runs a torch mixprec.Workload, got {type(workload).__name__}; "
            "the Keras monitor is not there yet."
        )
    dev = torch.device(device)
    pol = get_policy(policy, device=dev)
    model = pol.prepare(workload.model)
    optimizer = workload.make_optimizer(model)
    monitor = Monitor(
        model,
        pol,
        optimizer=optimizer,
        loss_fn=workload.loss_fn,
        every=every,
        shadow_every=shadow_every,
        rescue=rescue,
        train_steps=steps,
        events=events,
    )
    result = TrainResult(workload.name or "workload", policy, pol.config.to_dict(), steps, monitor.every)
    bs = batch_size or workload.default_batch_size
    torch.manual_seed(seed)  # batches drawn from the global generator: the same run every time
    try:
        with pol.precision_scope():
            for _ in range(steps):
                batch = workload.make_batch(bs, dev)
                with pol.autocast():
                    loss = workload.loss_fn(model, batch)
                optimizer.zero_grad(set_to_none=True)
                pol.backward(loss)
                pol.step(optimizer)
                monitor.observe(loss, batch)
    except MonitorStop as exc:
        result.stopped = str(exc)
    except Exception as exc:  # the policy's own ScaleCollapseError, say: the run ended, the record stays
        result.stopped = f"{type(exc).__name__}: {exc}"
    finally:
        monitor.close()
        result.losses = list(monitor.losses)
        result.scales = list(monitor.scales)
        result.skipped = list(monitor.skipped)
        result.findings = [f.to_dict() for f in monitor.findings]
        result.series = [s.to_dict() for s in monitor.sampler.recorder.series.values()]
        result.sample_steps = list(monitor.sampler.steps)
        result.every = monitor.every
        result.range_format = monitor.range_format
        result.final_policy = pol.config.to_dict()
        result.healthy = monitor.healthy and not result.stopped
    return result
