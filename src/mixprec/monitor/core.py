"""The precision autopilot's core: a :class:`Monitor` watches a long training run, asks its
detectors (:mod:`mixprec.monitor.detectors`) what each step and each sampled step shows, records
their findings and, with ``rescue=True``, runs the actions they ask for.

It costs what the user can afford:

* **every step**, at most one host read: a loss handed over before the update
  (:meth:`Monitor.before_step`) is read then, after the GradScaler's own read of its inf flag where
  there is one (one read a step on a GPU without a scaler: what judging a spike before its update
  costs); a loss only observed is kept as a device tensor (read at the next sampled step); the
  skipped flag comes from the policy's ``step()`` (which reads it anyway) or, in a plain
  ``torch.amp`` loop, from the scale GradScaler has just updated (its ``step()`` synchronises
  already for non-fused optimizers); a step between the sampled, timed and fed ones whose loss was
  read takes the gate's plain path (:mod:`~mixprec.monitor.gate`);
* **every** ``every`` **steps** (default 100): per-layer forward/backward abs-max and underflow
  share on the real step (:mod:`mixprec.monitor.sampler`), the losses since the last sample, a
  finite check of the weights, and the detectors' trends;
* **before each update** (where the loop hands its loss and batch over): the spike test, and on a
  spike the diagnosis, before the update lands (:mod:`~mixprec.monitor.gate`);
* **on a suspect step** (a skip below the scale the run settled at, a non-finite loss the host
  holds): an fp32 **shadow** of the same batch, to tell the data from the precision, and the first
  module whose output or gradient is not finite on it;
* **every** ``shadow_every`` **steps** (opt-in): a shadow step, for drift.

Each action is a finding and each is undone by nothing: the policy after a rescue is the policy for
the next run. ``hold`` steps pass between two actions; after ``max_rescues`` the monitor stops the
run rather than train on garbage: a plain loop's :meth:`Monitor.observe` raises
:class:`MonitorStop`, a framework adapter stops through the framework's own control
(:meth:`Monitor.record` and :attr:`Monitor.stopped`). A checkpoint of non-finite state is refused
(:meth:`Monitor.check_checkpoint`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.errors import MixprecError, UsageError
from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.detectors import (
    NONFINITE,
    SCALER_SKIPPED_NONFINITE,
    SKIP,
    Detector,
    SampleView,
    StepView,
    detectors_for,
)
from mixprec.monitor.detectors.base import FEED, Action, LossFn
from mixprec.monitor.findings import (
    CHECKPOINT_REFUSED,
    OPEN_KINDS,
    RESCUE,
    SCHEDULE,
    STOP,
    JsonlSink,
    MonitorFinding,
    Sink,
)
from mixprec.monitor.gate import UpdateGate, check_loss, unwrapped
from mixprec.monitor.rescue import Rescue, Rescuer, module_of, plan_schedule
from mixprec.monitor.sampler import Sampler
from mixprec.monitor.scale import ScaleWatch
from mixprec.numerics.limits import LOW_PRECISION_FORMATS
from mixprec.policy import Policy
from mixprec.policy.islands import is_fp32_island

log = logging.getLogger("mixprec.monitor")
LogFn = Callable[[str, float], None]  # a framework's metric logger: log_fn(name, value)


class MonitorStop(MixprecError):
    """A plain loop's monitor stopped the run: its rescues are spent and the run is still failing
    (a framework adapter stops through the framework instead; :attr:`Monitor.stopped` says why)."""


class PoisonedCheckpointError(MixprecError):
    """A checkpoint was asked for while weights or optimizer state hold inf/NaN; nothing was written."""


def _check_run(model: Any, policy: Any, scaler: Any) -> None:
    """One line for a model, policy or scaler the monitor cannot watch."""
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"Monitor watches a torch.nn.Module, got {type(model).__name__}; pass the model "
            "(for Keras, Lightning or the HF Trainer use their adapters in mixprec.monitor)."
        )
    if policy is not None and not isinstance(policy, Policy):
        raise UsageError(f"policy must be a mixprec Policy or None, got {type(policy).__name__}.")
    if policy is not None and scaler is not None:
        raise UsageError("pass a policy or a plain loop's GradScaler, not both: the policy owns its scaler.")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise UsageError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}.")
    if getattr(model, "_mixprec_monitor", None) is not None:
        raise UsageError("this model already has a mixprec Monitor; close() it first (one monitor per run).")


def _sinks(findings: str | Path | Sink | None) -> list[Sink]:
    """Where each finding goes besides the log: a JSONL file, or a callable."""
    if findings is None:
        return []
    if isinstance(findings, (str, Path)):
        return [JsonlSink(findings)]
    if callable(findings):
        return [findings]
    raise UsageError(f"findings must be a path or a callable, got {type(findings).__name__}.")


class RunRecord:
    """What one watched run did and what was done about it: its step and losses, the findings and
    the actions they led to, the stop, and the guard that keeps a checkpoint of non-finite state
    from being written. A :class:`Monitor` is one, and adds the watching: the detectors, the
    sampler and the update gate."""

    gate: UpdateGate  # (the Monitor's, made after this record)

    def __init__(
        self, config: MonitorConfig, rescuer: Rescuer, sinks: list[Sink], log_fn: LogFn | None
    ) -> None:
        self.config, self.rescuer, self.sinks, self.log_fn = config, rescuer, sinks, log_fn
        self.step = 0
        self.findings: list[MonitorFinding] = []
        self.losses: list[float] = []  # every step's loss, read at the sampled steps
        self.rescues = 0
        self.stopped = ""  # why the monitor stopped the run ('' while it has not)
        self.withheld: list[int] = []  # steps whose update the monitor withheld
        self._pending: list[torch.Tensor] = []  # device losses, read at the next sampled step
        self._host: bool | None = None  # whether the loss is on the host (read each step, no sync)
        self._last_action = -(10**9)
        self._seen: dict[tuple[str, str | None], int] = {}  # (kind, module): the step last reported
        self.tags: dict[str, Any] = {}  # evidence every finding carries (which of a script's models)

    def _keep_loss(self, loss: torch.Tensor | float, read: tuple[Any, float] | None) -> float | None:
        """Keep the step's loss: its value where the host holds it already (``read`` before the
        update, or a CPU run's: no sync, so a non-finite loss is seen at once), else the device
        tensor, read at the next sampled step."""
        if isinstance(loss, torch.Tensor):
            if self._host is None:
                self._host = loss.device.type == "cpu" and loss.numel() == 1
            if read is not None and read[0] is loss:
                value = read[1]  # (read before the update: a device loss too)
            elif not self._host:
                self._pending.append(loss.detach())
                return None
            else:
                value = loss.item()
        else:
            value = float(loss)
        if self._pending:
            self.read_losses()  # (the order of the losses is kept)
        self.losses.append(value)
        return value

    def read_losses(self) -> list[float]:
        """Every step's loss so far; the ones still on the device are read (one sync)."""
        if self._pending:
            self.losses += [
                float(v) for v in torch.stack([t.float().reshape(()) for t in self._pending]).cpu()
            ]
            self._pending = []
        return self.losses

    # ------------------------------------------------------------------ findings and actions
    def report(
        self,
        finding: MonitorFinding,
        rescue: Action | None = None,
        *,
        per_module: bool = True,
        local: Action | None = None,
        dedupe: bool = True,
    ) -> bool:
        """A detector's report (:meth:`mixprec.monitor.detectors.base.Run.report` says what it does)."""
        key = (finding.kind, finding.module if per_module else None)
        last = self._seen.get(key)
        if dedupe and last is not None and finding.step - last < max(self.config.hold, 1):
            return False
        self._seen[key] = finding.step
        if local is not None and self.config.rescue:
            done = local()
            if done:
                finding = replace(finding, action=done)
        self._emit(finding)
        if rescue is not None:
            self._act(finding, rescue)
        return True

    def _act(self, finding: MonitorFinding, rescue: Action) -> None:
        if not self.config.rescue or finding.step - self._last_action < self.config.hold:
            return  # alert only, or let the last action show its effect first
        if self.rescues >= self.config.max_rescues:
            self._stop(finding)
            return
        if self.data_parallel and isinstance(rescue, Rescue):
            self.gate.proposed = (finding, rescue)  # taken on every rank at the next agreement
            return
        self.take(finding, rescue)

    def take(self, finding: MonitorFinding, rescue: Action, **evidence: Any) -> None:
        """Take ``rescue``, in answer to ``finding`` (this rank's, or another's the ranks agreed)."""
        done = rescue()
        if done:
            self.rescues += 1
            self._last_action = finding.step
            said = {"answers": finding.kind, **evidence}
            self._emit(MonitorFinding(finding.step, RESCUE, done, finding.module, said, action=done))

    def stop(self, finding: MonitorFinding, why: str) -> None:
        """:meth:`mixprec.monitor.detectors.base.Run.stop`: before a guard of the loop's own stops the
        run blaming something else (a broken data pipeline collapses an fp16 loss scale, whose error
        names the precision)."""
        self._stop(finding, why)

    def _stop(self, finding: MonitorFinding, why: str | None = None) -> None:
        """Stop the run: a ``stop`` finding, and :attr:`stopped` for the loop or adapter to act on;
        ``why`` where it is not that the rescues are spent."""
        spent = (
            f"after {self.rescues} rescues (max_rescues={self.config.max_rescues}): the run is stopped "
            "rather than trained on garbage"
        )
        self.stopped = (
            f"step {finding.step}: {finding.kind} ({finding.message}) {why or spent}; the findings so "
            "far are the monitor's (Monitor.findings, its findings= sink)."
        )
        evidence = {"answers": finding.kind, "rescues": self.rescues}
        self._emit(MonitorFinding(finding.step, STOP, self.stopped, finding.module, evidence))

    @property
    def data_parallel(self) -> bool:
        """:attr:`mixprec.monitor.detectors.base.Run.data_parallel` (its ranks agree in the gate)."""
        gate = getattr(self, "gate", None)  # (None while the Monitor is being made)
        return gate is not None and gate.group is not None

    def _emit(self, finding: MonitorFinding) -> None:
        if self.data_parallel:  # which rank saw it, on every finding
            finding.evidence.setdefault("rank", self.gate.rank)
        finding.evidence.update(self.tags)
        self.findings.append(finding)
        log.warning(finding.line())
        for sink in self.sinks:
            sink(finding)
        if self.log_fn is not None:
            self.log_fn(f"mixprec/{finding.kind}", float(finding.step))

    def when_widened(self, step: Callable[[], str]) -> None:
        """Register a framework's own step after the monitor widened half weights to fp32 without
        a Policy (Lightning swaps its bf16-true precision plugin for bf16-mixed); ``step`` returns
        what it did, which the ``rescue`` finding adds."""
        self.rescuer.after_widening = step

    @property
    def skipped_batches(self) -> list[int]:
        """The batches whose update a data spike withheld (the skip list's content)."""
        return self.rescuer.skipped_batches

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_refusal(self) -> str | None:
        """Why a checkpoint must not be written now (the weights, the optimizer state or a saved
        buffer hold inf/NaN: every run resumed from it would train, or evaluate, on garbage),
        recorded as a finding; None when it may be. A buffer that held inf/NaN when the monitor was
        made (an attention mask of -inf) is by design and not checked."""
        bad = self.rescuer.nonfinite()
        remote = getattr(getattr(self, "gate", None), "remote_poisoned", None)
        if bad is None and remote is not None:  # (a save on rank 0 only: another rank's last check)
            self._emit(MonitorFinding(self.step, CHECKPOINT_REFUSED, f"checkpoint refused: {remote}"))
            return (
                f"checkpoint refused at step {self.step}: {remote}, and every run resumed from this "
                "data-parallel run would train on garbage there; roll back or fix the precision first "
                "(that rank's findings say where)."
            )
        if bad is None:
            return None
        message = f"checkpoint refused: {bad} is not finite"
        self._emit(MonitorFinding(self.step, CHECKPOINT_REFUSED, message, module_of(bad)))
        return (
            f"checkpoint refused at step {self.step}: {bad} holds inf/NaN, and every run resumed "
            f"from it would {'evaluate' if bad.endswith('(buffer)') else 'train'} on garbage; roll "
            "back (Monitor(snapshot_every=...)) or fix the precision first (the monitor's findings "
            "say where)."
        )

    def check_checkpoint(self) -> None:
        """Raise :class:`PoisonedCheckpointError` (and record a finding) when a checkpoint now
        would hold inf/NaN: what stops a framework's save before it writes anything."""
        reason = self.checkpoint_refusal()
        if reason is not None:
            raise PoisonedCheckpointError(reason)

    def save(self, obj: Any, path: str | Path) -> None:
        """``torch.save(obj, path)`` after :meth:`check_checkpoint`."""
        self.check_checkpoint()
        torch.save(obj, path)

    @property
    def healthy(self) -> bool:
        """No finding that blames the precision or the weights, and no spike, is left unanswered (by a
        rescue, a withheld or retried update), and none that no rescue answers (a ``divergence``
        fp32 shares, an ``unwatched`` loop) was found (:data:`~mixprec.monitor.findings.OPEN_KINDS`)."""
        acted = {f.step for f in self.findings if f.kind == RESCUE}
        open_ = [f for f in self.findings if f.kind in OPEN_KINDS and not (f.action or f.step in acted)]
        return not open_ and all(math.isfinite(v) for v in self.losses[-1:])


class Monitor(RunRecord):
    """Watches one training run. Call :meth:`observe` once per step, after the optimizer step, and
    (so a spike is diagnosed and withheld before its update lands) :meth:`before_step` after the
    backward, before the optimizer step.

    Args:
        model: the model being trained (prepared by ``policy`` when one is given).
        policy: the mixprec :class:`~mixprec.Policy` of the loop, or None for a plain loop.
        optimizer: the optimizer(s), for the finite check of their state, snapshots and checkpoints.
        scaler: a plain loop's ``torch.amp.GradScaler`` (a policy brings its own).
        loss_fn: ``loss_fn(model, batch)``, for the fp32 shadow (without it a skip is located from
            the gradients alone and no batch can be cleared).
        config: what it watches and may do (:class:`~mixprec.monitor.config.MonitorConfig`);
            ``fields`` replace the config's (``Monitor(model, policy, every=20, rescue=True)``).
        findings: a path (JSONL, appended) or a callable receiving each
            :class:`~mixprec.monitor.findings.MonitorFinding`.
        log_fn: ``log_fn(name, value)``, the framework's metric logger (Lightning ``log``).
        skip_list: where the batches whose update a data spike withheld are listed (a JSON list of
            batch indices, Lightning's ``skip_batches.json`` form; None: kept in
            :attr:`skipped_batches` only).
        autocast: the loop's own precision context, to replay a batch in it (default: the policy's
            autocast; a plain loop with a GradScaler: fp16 autocast; else none). An adapter passes
            its framework's.
    """

    def __init__(
        self,
        model: nn.Module,
        policy: Policy | None = None,
        *,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        loss_fn: LossFn | None = None,
        config: MonitorConfig | None = None,
        findings: str | Path | Sink | None = None,
        log_fn: LogFn | None = None,
        skip_list: str | Path | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        **fields: Any,
    ) -> None:
        if config is not None and not isinstance(config, MonitorConfig):
            raise UsageError(f"config must be a MonitorConfig, got {type(config).__name__}.")
        config = (config or MonitorConfig()).replace(**fields)
        self.replicated = isinstance(model, DistributedDataParallel)  # (every rank the whole model)
        self.dp_group = getattr(model, "process_group", None) if self.replicated else None
        if isinstance(model, DistributedDataParallel):
            # the monitor's own replays and hooks on the module inside: a replay runs on the one rank
            # that saw the spike, and DDP's forward (buffer broadcast) would wait for the others
            model = model.module
        _check_run(model, policy, scaler)  # (one monitor per model: the module a wrapper holds too)
        self.schedule = plan_schedule(config.schedule or {}, config.train_steps, policy)
        given = [] if optimizer is None else optimizer if isinstance(optimizer, Sequence) else [optimizer]
        self.optimizers = [unwrapped(o) for o in given]
        rescuer = Rescuer(model, policy, self.optimizers, skip_list)
        super().__init__(config, rescuer, _sinks(findings), log_fn)  # (a JSONL sink: after the checks)
        self.model, self.policy, self.loss_fn = model, policy, loss_fn
        self.scale = ScaleWatch(policy, scaler)
        self._autocast = autocast
        fmt = policy.spec.range_format if policy is not None else ("fp16" if scaler is not None else None)
        self.range_format = fmt if fmt in LOW_PRECISION_FORMATS else None
        # the stalls are counted at each update, by the optimizers' post-step hook (UpdateGate.after_update)
        every, steps, hooked = self.config.every, self.config.train_steps, bool(self.optimizers)
        self.sampler = Sampler(model, self.range_format, every, steps, updates_hooked=hooked)
        self.detectors = detectors_for(self.config)
        # each hook asks only the detectors that have it (most steps ask none)
        self._explaining = [d for d in self.detectors if type(d).on_suspect is not Detector.on_suspect]
        self._stepping = [d for d in self.detectors if type(d).on_step is not Detector.on_step]
        self._sampling = [d for d in self.detectors if type(d).on_sample is not Detector.on_sample]
        self._feeding = [d for d in self.detectors if type(d).on_losses is not Detector.on_losses]
        self._hooks: list[Any] = []  # an adapter's own optimizer hooks, removed at close()
        self._closed = False
        self._analysed_to = -1
        self._explained: set[int] = set()  # steps a detector explained since the last sample
        self._fed_to = -1  # the last step whose loss the detectors' ranges have seen
        self.control_batch: Any = None  # the latest batch whose loss was normal (Run.control_batch)
        # before the update and right after it (while the gradients are still there): what
        # before_step handed over, withheld updates, the stalls, the plain path
        self.gate = UpdateGate(self, scaler)
        model._mixprec_monitor = self  # type: ignore[assignment]
        self.sampler.begin(0)
        self.gate.hook_updates()

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """A plain loop's GradScaler (an adapter replaces it when the framework's changes)."""
        return self.scale.scaler

    @scaler.setter
    def scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scale.scaler = scaler

    @property
    def skipped(self) -> list[int]:
        return self.scale.skipped

    @property
    def scales(self) -> list[tuple[int, float]]:
        return self.scale.scales

    @property
    def every(self) -> int:
        """The steps between two sampled steps now (it grows when ``every=None`` and sampling
        costs more than its budget)."""
        return self.sampler.interval

    # ------------------------------------------------------------------ a step
    def observe(self, loss: torch.Tensor | float, batch: Any = None) -> list[MonitorFinding]:
        """Record step ``self.step`` (call after the optimizer step); returns its new findings.

        ``loss``: the step's loss, a scalar tensor or a number (a per-sample vector is refused:
        reduce it as the backward did). ``batch``: the step's batch, for the fp32 shadow on a
        suspect step (kept only for this call). After :meth:`close` it refuses (``UsageError``).
        A plain loop has no flag to stop by: when the monitor stops the run (its rescues spent and
        the run still failing: a ``stop`` finding) this raises :class:`MonitorStop`."""
        if self._closed:
            raise UsageError(
                f"observe() after close(): this Monitor was closed at step {self.step} and watches "
                "nothing more (its hooks are removed); make a new Monitor to watch another run."
            )
        new = self._record(loss, batch, "observe")
        gate = self.gate
        if self.stopped and (gate.group is None or gate.stop_agreed or not self.optimizers):
            # (no optimizer: no pre-step hook agrees it; the rank stops at once, as before)
            # (over data-parallel ranks, once every rank knows: the next pre-step hook agrees it)
            raise MonitorStop(self.stopped)
        return new

    def record(self, loss: torch.Tensor | float, batch: Any = None) -> list[MonitorFinding]:
        """:meth:`observe` for a framework adapter: it never raises; when the monitor stops the run,
        :attr:`stopped` says why and the adapter stops the framework its own way
        (``control.should_training_stop``, ``trainer.should_stop``). A stopped monitor records
        nothing more, and a closed one stays closed (a framework hook after the run's end)."""
        return self._record(loss, batch, "record")

    def _record(self, loss: torch.Tensor | float, batch: Any, call: str) -> list[MonitorFinding]:
        self.gate.agreed = False  # (the next optimizer step's decision is agreed anew)
        value = self.gate.plain(loss, self.step)
        if value is not None:  # a plain step (the common one): the loss kept, the step counted
            self.losses.append(value)
            self.step += 1
            return []
        if self.stopped or self._closed:
            self.gate.staged = self.gate.read = None
            return []
        check_loss(loss, call)
        step, before = self.step, len(self.findings)
        sampled = step % self.sampler.interval == 0
        skipped = self.scale.after_step(step, sampled)
        value = self._keep_loss(loss, self.gate.settle(step))
        if sampled:
            self.sampler.end(step, self.scale.current if self.policy is None else self.scale.read(), skipped)
        batch = batch if self.loss_fn is not None else None  # without a loss_fn nothing can run it
        suspect = None  # (a normal step: a finite loss, not skipped, costs one comparison here)
        if (
            skipped or (value is not None and not -math.inf < value < math.inf)
        ) and step not in self._explained:
            suspect = self._suspect(step, skipped, value, batch)  # (one diagnosed before its update is not)
        if (suspect is not None or self._stepping) and not self._ask(
            StepView(step, skipped, value, batch, suspect)
        ):
            return self.findings[before:]
        if sampled and not self._sample(step):
            return self.findings[before:]
        if (
            self._feeding
            and (sampled or (value is not None and step - self._fed_to >= FEED))
            and not self._feed()
        ):
            return self.findings[before:]
        if self.schedule:
            name = self.schedule.get(step)
            if name is not None:
                done = self.rescuer.switch(name)
                self._emit(MonitorFinding(step, SCHEDULE, done, action=done))
        if self.config.snapshot_every and step % self.config.snapshot_every == 0:
            self.rescuer.take_snapshot(step)
        self.step += 1
        self.sampler.next(self.step)
        self.gate.hook_updates()
        self.gate.plain_until = self._next_busy_step()
        return self.findings[before:]

    def _next_busy_step(self) -> int:
        """The first step from :attr:`step` on whose :meth:`observe` has more to do than keep its
        loss and count it (the gate's plain path, :meth:`UpdateGate.plain`): the sampler's next
        timed or sampled step, the detectors' next feed. Runs whose every step needs the whole path
        (a loop not yet confirmed, detectors that look at every step, a schedule or snapshots, a
        plain loop's GradScaler whose scale is read each step, GradScaler's start-up) get
        :attr:`step` itself."""
        step, policy = self.step, self.policy
        if (
            policy is None
            or self.stopped
            or self._closed
            or self.gate.unconfirmed
            or self._stepping
            or self.schedule
            or self.config.snapshot_every
            or self.scale.starting(step)
            or (policy.scaler is not None and self.scale.settled is None)
        ):
            return step
        busy = self.sampler.untimed_until(step)
        if self._feeding:
            busy = min(busy, self._fed_to + FEED)
        return max(busy, step)

    # ------------------------------------------------------------------ before the update
    def before_step(
        self,
        loss: torch.Tensor | float,
        batch: Any = None,
        *,
        batch_index: int | None = None,
        grad_norm: float | None = None,
    ) -> None:
        """Hand the step's loss and batch over after the backward and before the optimizer step: when
        the optimizer steps (its pre-step hook), a spike in them is found and diagnosed from the same
        weights and, with ``rescue=True``, its update withheld, rescued or retried before it lands.
        ``batch_index``: where the loop gives it (what a skip list names; default: the step);
        ``grad_norm``: the gradient norm where the loop has it for free (what ``clip_grad_norm_``
        returned). The loss is read here and compared with the detectors' quick limit: a normal step
        arms no optimizer hook. That read is free for a CPU loss and one host read a step for a GPU
        loss (what judging a spike before its update costs); where a GradScaler reads its inf flag
        anyway, a GPU loss is read in the optimizer's pre-step hook, after that read. :meth:`observe`
        still follows the step."""
        self.gate.before_step(loss, batch, batch_index, grad_norm)

    def check_update(self, optimizer: Any) -> bool:
        """Check what :meth:`before_step` handed over, once per step, before ``optimizer`` applies
        the update (the optimizers' pre-step hooks do; an adapter whose framework runs the backward
        inside ``optimizer.step``, Lightning's closure, calls it from its own hook after the
        backward). Returns whether the update is withheld: ``optimizer`` is then handed no gradient
        (they are back after its step). A step its GradScaler found inf/NaN in is the skip path's."""
        return self.gate.check_update(optimizer)

    # the gate's optimizer hooks as they stand (tests/monitor/test_monitor_plain_steps.py reads them)
    @property
    def _armed(self) -> list[Any]:
        return self.gate.armed

    @property
    def _after(self) -> list[Any]:
        return self.gate.after

    def _feed(self) -> bool:
        """The host's losses since the last feed to the detectors that keep a range of them (every
        :data:`FEED` steps, and at sampled steps where a GPU run's losses are read); False when the
        run was stopped."""
        start, values = self._fed_to + 1, self.losses[self._fed_to + 1 :]
        if not values:
            return True
        self._fed_to += len(values)
        judged = set(self.skipped[-len(values) :]) | self._explained
        for detector in self._feeding:
            detector.on_losses(self, start, values, judged)
            if self.stopped:
                return False
        self.gate.requiet()
        return True

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's own precision context (a replay in the policy runs in it)."""
        if self._autocast is not None:
            return self._autocast()
        if self.policy is not None:
            return self.policy.autocast()
        if self.scale.scaler is not None and self.scale.scaler.is_enabled():
            device = next(self.model.parameters()).device.type
            return torch.autocast(device, dtype=torch.float16)
        return contextlib.nullcontext()

    def _ask(self, view: StepView) -> bool:
        """A suspect step to the detectors until one explains it, then the step to those that look
        at every step; False when the run was stopped."""
        if view.suspect is not None:
            for detector in self._explaining:
                view.explained = detector.on_suspect(self, view)
                if self.stopped:
                    return False
                if view.explained:
                    self._explained.add(view.step)
                    break
        for detector in self._stepping:
            view.explained = detector.on_step(self, view) or view.explained
            if self.stopped:
                return False
        return True

    def _suspect(self, step: int, skipped: bool, value: float | None, batch: Any) -> str | None:
        """Why ``step`` needs explaining: a skip that is news (not GradScaler's own rhythm), or a
        non-finite loss the host holds with a batch to shadow, skipped or not (a NaN batch during the
        loss scaler's start-up is the data's, not the scaler's search); None for a normal step."""
        if skipped and self.scale.news(step):
            return SKIP
        if value is not None and batch is not None and not math.isfinite(value):
            return SCALER_SKIPPED_NONFINITE if skipped else NONFINITE
        return None

    # ------------------------------------------------------------------ a sampled step
    def _sample(self, step: int) -> bool:
        """Ask the detectors about the sampled ``step``; False when the run was stopped."""
        losses = self.read_losses()
        if self.log_fn is not None and losses:
            self.log_fn("mixprec/loss_scale", self.scales[-1][1] if self.scales else float("nan"))
        fresh = losses[len(losses) - (step - self._analysed_to) :] if step > self._analysed_to else []
        # a skipped step's loss was judged by the skip, and a step with a finding by that finding
        judged = set(self.skipped) | self._explained
        self._analysed_to, self._explained = step, set()
        islands = tuple(n for n, m in self.model.named_modules() if getattr(m, "_fp32_island", False))
        series = [s for s in self.sampler.recorder.series.values() if not is_fp32_island(s.name, islands)]
        view = SampleView(step, fresh, step - len(fresh) + 1, judged, islands, series)
        for detector in self._sampling:
            if detector.on_sample(self, view):
                view.explained = True
            if self.stopped:
                return False
        return True

    def _stop(self, finding: MonitorFinding, why: str | None = None) -> None:
        self.gate.plain_until = 0  # (a stopped run takes no step more, plain or whole)
        super()._stop(finding, why)

    def close(self) -> None:
        """Read the losses still on the device (the detectors that keep a range of them see the
        last ones), remove the hooks and detach from the model. A closed monitor stays closed:
        :meth:`observe` refuses, :meth:`record` and :meth:`before_step` do nothing (a framework
        hook after the run's end); its record, :meth:`state_dict` and the checkpoint guard stay."""
        if self._closed:
            return
        self._closed = True
        self.read_losses()
        if self._feeding and not self.stopped:
            self._feed()
        self.sampler.abandon()
        self.gate.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if getattr(self.model, "_mixprec_monitor", None) is self:
            del self.model._mixprec_monitor

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to judge as this one would: the step, the ranges and
        losses its trends and spike tests read, the scale it settled at, its findings and actions,
        and each detector's own state."""
        state: dict[str, Any] = {
            "step": self.step,
            "rescues": self.rescues,
            "last_action": self._last_action,
            "analysed_to": self._analysed_to,
            "losses": list(self.read_losses()),
            **self.scale.state_dict(),
            "seen": [[kind, module, step] for (kind, module), step in self._seen.items()],
            "sampler": self.sampler.state_dict(),
            "findings": [f.to_dict() for f in self.findings],
            "policy": self.policy.config.to_dict() if self.policy is not None else None,
            "withheld": list(self.withheld),
            "skipped_batches": list(self.skipped_batches),
            "fed_to": self._fed_to,
        }
        for detector in self.detectors:
            state.update(detector.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (before the first :meth:`observe` of the resumed run)."""
        self.step = int(state["step"])
        self.rescues = int(state["rescues"])
        self._last_action = int(state.get("last_action", self._last_action))
        self._analysed_to = int(state.get("analysed_to", self.step - 1))
        self.losses = [float(v) for v in state.get("losses") or []]
        self._pending = []
        self._seen = {(kind, module): int(step) for kind, module, step in state.get("seen") or []}
        self.sampler.load_state_dict(state.get("sampler") or {})
        self.findings = [MonitorFinding(**f) for f in state.get("findings") or []]
        self.withheld = [int(v) for v in state.get("withheld") or []]
        self.rescuer.skipped_batches = [int(v) for v in state.get("skipped_batches") or []]
        self.scale.load_state_dict(dict(state))
        for detector in self.detectors:
            detector.load_state_dict(state)
        self._fed_to = int(state.get("fed_to", self.step - 1))
        self.gate.requiet()
        self.gate.plain_until = 0
        self.sampler.begin(self.step)
        self.gate.hook_updates()
