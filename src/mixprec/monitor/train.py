"""`mixprec train`'s loop: a workload trained ``steps`` steps under a :class:`~mixprec.Candidate`
with the monitor, the long-run ground truth a user can get in one command (and the way to try a
rescue). The candidate is applied whole, as a training loop would: its policy (with channels_last,
keep_fp32 and the precision map), its compile mode and scope, its optimizer implementation and its
micro-batches."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, cast

import torch
from torch import nn

from mixprec.errors import UsageError
from mixprec.frameworks.torch.session import with_implementation
from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.core import Monitor
from mixprec.monitor.findings import STOP, MonitorFinding, Sink
from mixprec.policy import Candidate, Policy, get_policy
from mixprec.policy.candidate import check_torch_axes
from mixprec.workload import Workload
from mixprec.workload.validate import validate_workload


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
        healthy: no finding that blames the precision, and no spike, was left unanswered and the
            loss is finite.
        stopped: why the run stopped early ('' when it ran all its steps).
        withheld: the steps whose update the monitor withheld (a data or precision spike, rescued).
        skipped_batches: the batches a data spike put on the skip list (each step draws its own
            batch: its index is the step's).
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
    withheld: list[int] = field(default_factory=list)
    skipped_batches: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = dict(vars(self))
        data["losses"] = [v if math.isfinite(v) else str(v) for v in self.losses]
        return data


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C (or the CLI's SIGTERM) stopped :func:`train` between two steps: ``result`` is what the
    run measured up to there, whole (its ``stopped`` names the step); ``__cause__`` is the
    interrupt itself. A caller that does not catch it sees a KeyboardInterrupt, as without mixprec."""

    def __init__(self, result: TrainResult) -> None:
        super().__init__(result.stopped)
        self.result = result


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
    cand: Candidate,
    workload: Workload,
    model: nn.Module,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    before_update: Callable[[torch.Tensor, list[Any]], None] | None = None,
) -> Callable[[list[Any]], torch.Tensor]:
    """One optimizer step over a list of micro-batches (one without accumulation): each loss
    divided by their number, the gradients summed, one step; compiled as the candidate says.
    ``before_update(loss, micro)``: after the backward, before the optimizer step (the monitor's
    spike check; not in a step compiled whole, where the update is one graph with the backward)."""
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
        if before_update is not None and cand.compile_scope != "step":
            before_update(loss, micro)
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
    skip_list: str | Path | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train ``workload`` for ``steps`` optimizer steps under ``candidate`` (a Candidate or a policy
    name) with a :class:`Monitor` configured by ``config`` (its ``train_steps`` set to ``steps``).

    ``batch_size``: samples per step (default: the workload's); a candidate's ``micro_batch`` and
    ``accumulation_steps`` replace it (each step that many micro-batches of that size).
    ``progress``: called after each step with its ``step`` (1-based), ``steps``, ``loss``, ``skipped``
    (steps skipped so far) and ``findings`` (so far); the CLI prints a line from it.
    ``findings``: the monitor's sink (a JSONL path or a callable); ``skip_list``: where the batches
    whose update a data spike withheld are listed (a JSON list of their indices, the steps). The
    loss and the step's micro-batches are handed to the monitor before each optimizer step, so a
    spike is diagnosed and (``rescue``) withheld, rescued or retried before its update lands. When
    the monitor stops the run (its rescues spent) the run ends early (``stopped``); what was
    measured is kept.

    Before the run, one strict-fp32 step checks the workload (``validate_workload``, as ``bench`` and
    ``check`` do): a loss that is not a finite scalar, a model with nothing to train, a broken
    optimizer is a :class:`UsageError` naming the function, not an unhealthy run. Ctrl-C between
    steps raises :class:`TrainInterrupted` carrying the result so far (a ``stop`` finding, sent to
    ``findings`` too, names the step)."""
    if not isinstance(workload, Workload):
        raise UsageError(
            f"mixprec train runs a torch mixprec.Workload, got {type(workload).__name__}; "
            "the Keras monitor is not there yet."
        )
    cand = _candidate(candidate)
    dev = torch.device(device)
    size = cand.micro_batch or batch_size or workload.default_batch_size
    torch.manual_seed(seed)  # batches drawn from the global generator: the same run every time
    first = _validated_first_batch(workload, dev, size)
    drawn = _rng_state(dev)  # the run's next batches as if nothing ran in between
    pol = get_policy(cand, device=dev)
    model = pol.prepare(workload.model)
    optimizer = workload.make_optimizer(model)
    if cand.optimizer:
        optimizer = with_implementation(optimizer, cand.optimizer)
    config = (config or MonitorConfig()).replace(train_steps=steps)
    monitor = Monitor(
        model,
        pol,
        optimizer=optimizer,
        loss_fn=_shadow_loss(workload),
        config=config,
        findings=findings,
        skip_list=skip_list,
    )
    result = TrainResult(workload.name or "workload", cand.label, pol.config.to_dict(), steps, monitor.every)
    result.candidate = cand.to_dict()
    before = lambda loss, micro: monitor.before_step(loss, micro, batch_index=monitor.step)  # noqa: E731
    step = _step_fn(cand, workload, model, pol, optimizer, before)
    _set_rng_state(dev, drawn)
    if progress is not None:  # validated and ready: step 0 of the run
        progress({"step": 0, "steps": steps, "loss": float("nan"), "skipped": 0, "findings": 0})
    interrupted: KeyboardInterrupt | None = None
    try:
        with pol.precision_scope(), _ctrl_c_between_steps() as pressed:
            for i in range(steps):
                if pressed:  # Ctrl-C during the step before: it ended whole, stop here
                    raise KeyboardInterrupt
                given = first if i == 0 else []  # the batch the validation step drew, trained on here
                micro = [
                    *given,
                    *(workload.make_batch(size, dev) for _ in range(cand.accumulation_steps - len(given))),
                ]
                monitor.record(step(micro), micro)
                if progress is not None:
                    last = monitor.losses[-1] if monitor.losses else float("nan")
                    progress(
                        {
                            "step": i + 1,
                            "steps": steps,
                            "loss": last,
                            "skipped": len(monitor.skipped),
                            "findings": len(monitor.findings),
                        }
                    )
                if monitor.stopped:
                    result.stopped = monitor.stopped
                    break
    except KeyboardInterrupt as exc:  # Ctrl-C: what the finished steps measured is kept, whole
        interrupted = exc
    except Exception as exc:  # the policy's own ScaleCollapseError, say: the run ended, the record stays
        result.stopped = f"{type(exc).__name__}: {exc}"
    finally:
        monitor.close()
    if interrupted is not None:
        done = monitor.step
        result.stopped = f"interrupted at step {done} of {steps}: the {done} steps before it are recorded"
        stop = MonitorFinding(done, STOP, result.stopped)
        monitor.findings.append(stop)
        for sink in monitor.sinks:
            sink(stop)
    _fill(result, monitor, pol)
    if interrupted is not None:
        raise TrainInterrupted(result) from interrupted
    return result


def _validated_first_batch(workload: Workload, device: torch.device, size: int) -> list[Any]:
    """One strict-fp32 step on a copy of the model before the run, as bench and check check a
    workload: a broken one is one UsageError line naming the function. Its batch is the run's
    first (returned, [] where none was drawn: out of memory) and the generators are left after it:
    a make_batch that counts its calls (a fault planted at batch 150) sees the run's draws only."""
    drawn: list[Any] = []
    after: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def make_batch(batch_size: int, dev: torch.device) -> Any:
        if not drawn:  # validation forks the generators: keep their state after this draw
            drawn.append(workload.make_batch(batch_size, dev))
            after.append(_rng_state(device))
        return drawn[0]

    validate_workload(replace(workload, make_batch=make_batch), device=device, batch_size=size)
    if after:
        _set_rng_state(device, after[0])
    return drawn


@contextlib.contextmanager
def _ctrl_c_between_steps() -> Iterator[list[bool]]:
    """While the loop runs, a first Ctrl-C is held until the step in flight has ended (and been
    recorded): the run stops between two steps, its record whole. A second Ctrl-C interrupts at
    once. Only where Python's own handler is installed, in the main thread (else nothing changes)."""
    pressed: list[bool] = []
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield pressed
        return

    def hold(signum: int, frame: FrameType | None) -> None:
        pressed.append(True)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, hold)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.random.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


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
    result.withheld = list(monitor.withheld)
    result.skipped_batches = list(monitor.skipped_batches)
    result.healthy = monitor.healthy and not result.stopped
