"""`mixprec train`'s loop: a workload trained ``steps`` steps under a :class:`~mixprec.Candidate`
with the monitor, the long-run ground truth a user can get in one command (and the way to try a
rescue). The candidate is applied whole, as a training loop would: its policy (with channels_last,
keep_fp32 and the precision map), its compile mode and scope, its optimizer implementation and its
micro-batches."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from mixprec.errors import UsageError
from mixprec.frameworks.torch.session import with_implementation
from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.core import Monitor
from mixprec.monitor.findings import Sink
from mixprec.policy import Candidate, Policy, get_policy
from mixprec.policy.candidate import check_torch_axes
from mixprec.workload import Workload


@dataclass
class TrainResult:
    """What a monitored run did, step by step.

    Attributes:
        policy / final_policy: the candidate's label it started with, and the policy it ended with
            (after any rescue: the policy for the next run, with its keep_fp32 islands).
        candidate: the candidate it ran (``Candidate.to_dict()``).
        losses / scales / skipped: per optimizer step (scales where the policy has a scaler).
        findings: the monitor's findings (``MonitorFinding.to_dict()``).
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
    candidate: dict[str, Any] = field(default_factory=dict)
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


def _candidate(candidate: Candidate | str) -> Candidate:
    """The candidate a training loop can run: a torch one, not emulated (emulation is check's)."""
    cand = candidate if isinstance(candidate, Candidate) else Candidate(candidate)
    if cand.framework != "torch":
        raise UsageError(f"mixprec train runs torch candidates; {cand.label} is a {cand.framework} one.")
    if cand.emulate is not None:
        raise UsageError(
            f"{cand.label}: emulated formats are check's (strict fp32 under emulation), not a run's."
        )
    check_torch_axes(cand)
    return cand


def _step_fn(
    cand: Candidate, workload: Workload, model: nn.Module, policy: Policy, optimizer: torch.optim.Optimizer
) -> Callable[[list[Any]], torch.Tensor]:
    """One optimizer step over a list of micro-batches (one without accumulation): each loss
    divided by their number, the gradients summed, one step; compiled as the candidate says."""
    trained = model
    if cand.compile and cand.compile_scope is None:
        trained = cast(nn.Module, torch.compile(model, mode=cand.compile))

    def step(micro: list[Any]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        if len(micro) == 1:
            with policy.autocast():
                loss = workload.loss_fn(trained, micro[0])
            policy.backward(loss)
        else:
            parts = []
            for batch in micro:
                with policy.autocast():
                    part = workload.loss_fn(trained, batch) / len(micro)
                policy.backward(part)
                parts.append(part.detach())
            loss = torch.stack(parts).sum()
        policy.step(optimizer)
        return loss

    if cand.compile and cand.compile_scope == "step":  # forward, backward and the update together
        return cast(Callable[[list[Any]], torch.Tensor], torch.compile(step, mode=cand.compile))
    return step


def _shadow_loss(workload: Workload) -> Callable[[nn.Module, list[Any]], torch.Tensor]:
    """The monitor's ``loss_fn`` for a step's micro-batches: their mean loss, as the step took it."""

    def loss_fn(model: nn.Module, micro: list[Any]) -> torch.Tensor:
        if len(micro) == 1:
            return workload.loss_fn(model, micro[0])
        return torch.stack([workload.loss_fn(model, b) for b in micro]).mean()

    return loss_fn


def train(
    workload: Workload,
    candidate: Candidate | str,
    steps: int,
    *,
    config: MonitorConfig | None = None,
    device: str = "cpu",
    batch_size: int | None = None,
    findings: str | Path | Sink | None = None,
    seed: int = 0,
) -> TrainResult:
    """Train ``workload`` for ``steps`` optimizer steps under ``candidate`` (a Candidate or a policy
    name) with a :class:`Monitor` configured by ``config`` (its ``train_steps`` set to ``steps``).

    ``batch_size``: samples per step (default: the workload's); a candidate's ``micro_batch`` and
    ``accumulation_steps`` replace it (each step that many micro-batches of that size).
    ``findings``: the monitor's sink (a JSONL path or a callable). When the monitor stops the run
    (its rescues spent) the run ends early (``stopped``); what was measured is kept."""
    if not isinstance(workload, Workload):
        raise UsageError(
            f"mixprec train runs a torch mixprec.Workload, got {type(workload).__name__}; "
            "the Keras monitor is not there yet."
        )
    cand = _candidate(candidate)
    dev = torch.device(device)
    pol = get_policy(cand, device=dev)
    model = pol.prepare(workload.model)
    optimizer = workload.make_optimizer(model)
    if cand.optimizer:
        optimizer = with_implementation(optimizer, cand.optimizer)
    config = (config or MonitorConfig()).replace(train_steps=steps)
    monitor = Monitor(
        model, pol, optimizer=optimizer, loss_fn=_shadow_loss(workload), config=config, findings=findings
    )
    result = TrainResult(workload.name or "workload", cand.label, pol.config.to_dict(), steps, monitor.every)
    result.candidate = cand.to_dict()
    step = _step_fn(cand, workload, model, pol, optimizer)
    size = cand.micro_batch or batch_size or workload.default_batch_size
    torch.manual_seed(seed)  # batches drawn from the global generator: the same run every time
    try:
        with pol.precision_scope():
            for _ in range(steps):
                micro = [workload.make_batch(size, dev) for _ in range(cand.accumulation_steps)]
                monitor.record(step(micro), micro)
                if monitor.stopped:
                    result.stopped = monitor.stopped
                    break
    except Exception as exc:  # the policy's own ScaleCollapseError, say: the run ended, the record stays
        result.stopped = f"{type(exc).__name__}: {exc}"
    finally:
        monitor.close()
        _fill(result, monitor, pol)
    return result


def _fill(result: TrainResult, monitor: Monitor, policy: Policy) -> None:
    """What the monitor recorded of the run, into ``result``."""
    result.losses = list(monitor.losses)
    result.scales = list(monitor.scales)
    result.skipped = list(monitor.skipped)
    result.findings = [f.to_dict() for f in monitor.findings]
    result.series = [s.to_dict() for s in monitor.sampler.recorder.series.values()]
    result.sample_steps = list(monitor.sampler.steps)
    result.every = monitor.every
    result.range_format = monitor.range_format
    result.final_policy = policy.config.to_dict()
    result.healthy = monitor.healthy and not result.stopped
