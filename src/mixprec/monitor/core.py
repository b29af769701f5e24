"""The precision autopilot: a monitor that watches a long training run, tells a precision failure
from a bad batch, and (``rescue=True``) rescues it.

It costs what the user can afford:

* **every step**, nothing the step does not already pay for: the loss is kept as a device tensor
  (read at the next sampled step), the skipped flag comes from the policy's ``step()`` (which
  reads it anyway) or, in a plain ``torch.amp`` loop, from the scale GradScaler has just updated
  (its ``step()`` synchronises already for non-fused optimizers);
* **every** ``every`` **steps** (default 100): per-layer forward/backward abs-max and underflow
  share on the real step (hooks attached at the end of the step before, removed after it), the
  stalled-update share of half-precision weights, the losses since the last sample, a finite
  check of the weights, and the trend of :mod:`mixprec.numerics.trend`: a layer predicted to
  overflow within the run is a finding before it happens;
* **on a skipped step** (the scale fell below the level the run had settled at, not GradScaler's
  normal back-off after a growth): an fp32 **shadow** forward on the same batch: if fp32 shows the
  spike too, the batch is to blame, not the precision; otherwise the first module whose output or
  gradient is non-finite is located on that batch;
* **every** ``shadow_every`` **steps** (opt-in): a shadow step, forward and backward in the policy
  and in fp32 on the same batch (weights, gradients, buffers and RNG restored): gradient SQNR
  against the value measured at the first shadow; a fall of ``DRIFT_DB`` is drift.

With ``rescue=True`` it acts on what blames the precision, each action a finding and each undoable
by the next run's policy: a module that overflows becomes an fp32 island live
(:meth:`Policy.keep_fp32_now`); a collapsing fp16 scale switches the run to bf16-mixed where the
device has bf16 (:meth:`Policy.switch`, weights and optimizer state carried over); non-finite
weights roll back to the last in-memory snapshot (``snapshot_every``). ``hold`` steps must pass
between two actions; after ``max_rescues`` it stops the run (:class:`MonitorStop`) rather than
train on garbage. A checkpoint of non-finite state is refused (:meth:`check_checkpoint`).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError, UsageError
from mixprec.frameworks.torch.ranges import StepRecorder, collect_ranges
from mixprec.monitor.findings import (
    BAD_BATCH,
    CHECKPOINT_REFUSED,
    DRIFT,
    NONFINITE_WEIGHTS,
    OVERFLOW,
    PRECISION_KINDS,
    PREDICTED_OVERFLOW,
    RESCUE,
    SCALE_COLLAPSE,
    SCHEDULE,
    STALL,
    UNDERFLOW,
    Finding,
    JsonlSink,
    Sink,
)
from mixprec.monitor.rescue import Rescuer, nonfinite_state, plan_schedule
from mixprec.monitor.shadow import fp32_loss, shadow_sqnr
from mixprec.numerics.limits import LOW_PRECISION_FORMATS
from mixprec.numerics.trend import LayerSeries, least_headroom, outlook, predict
from mixprec.policy import Policy
from mixprec.policy.islands import is_fp32_island

log = logging.getLogger("mixprec.monitor")

EVERY = 100
# A skip that drops the scale this many halvings below the level the run settled at, in a row of
# skips, is a collapse (GradScaler's own floor, min_scale, would stop the run a few skips later).
COLLAPSE_HALVINGS = 6
# A loss this many median absolute deviations above the recent median is a spike.
SPIKE_MADS = 10.0
RECENT = 50  # losses the spike test compares with
WINDOW = 32  # sampled steps a trend is fitted on (the latest)
DRIFT_DB = 20.0
STALL_LIMIT = 0.05  # the *-true check's max_stalled_update_fraction
HOLD = 50
MAX_RESCUES = 3


class MonitorStop(MixprecError):
    """The monitor stopped the run: its rescues are spent and the run is still failing."""


class PoisonedCheckpointError(MixprecError):
    """A checkpoint was asked for while weights or optimizer state hold inf/NaN; nothing was written."""


def _positive_int(name: str, value: Any, zero_ok: bool = False) -> int:
    low = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"Monitor {name} must be an integer >= {low}, got {value!r}.")
    return value


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer): its step hooks fire, its state is the real one."""
    while not hasattr(optimizer, "_optimizer_step_post_hooks") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    return optimizer


def _on_host(loss: Any) -> bool:
    return isinstance(loss, torch.Tensor) and loss.device.type == "cpu"


def _spikes(value: float, recent: Sequence[float]) -> bool:
    """``value`` is not finite, or ``SPIKE_MADS`` median absolute deviations above the median."""
    if not math.isfinite(value):
        return True
    median = statistics.median(recent)
    mad = statistics.median(abs(v - median) for v in recent) or abs(median) * 1e-3 or 1e-12
    return value > median + SPIKE_MADS * mad


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


class Monitor:
    """Watches one training run. Call :meth:`observe` once per step, after the optimizer step.

    Args:
        model: the model being trained (prepared by ``policy`` when one is given).
        policy: the mixprec :class:`~mixprec.Policy` of the loop, or None for a plain loop.
        optimizer: the optimizer(s), for the finite check of their state, snapshots and checkpoints.
        scaler: a plain loop's ``torch.amp.GradScaler`` (a policy brings its own).
        loss_fn: ``loss_fn(model, batch)``, for the fp32 shadow (without it a skip is located from
            the gradients alone and no batch can be cleared).
        every: steps between sampled steps (ranges, losses, trends, weight checks).
        shadow_every: steps between fp32 shadow steps (0: only on skipped steps).
        rescue: act on precision findings (False: alert only; the run is never touched).
        train_steps: the run's length, for predictions.
        snapshot_every: steps between in-memory snapshots to roll back to (0: none).
        schedule: ``{step or fraction of train_steps: policy name}``: planned switches (e.g. to
            fp32 for the end of the run).
        hold / max_rescues: steps between two actions; actions before the run is stopped.
        events: a path (JSONL, appended) or a callable receiving each :class:`Finding`.
        log_fn: ``log_fn(name, value)``, the framework's metric logger (Lightning ``log``).
    """

    def __init__(
        self,
        model: nn.Module,
        policy: Policy | None = None,
        *,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        every: int = EVERY,
        shadow_every: int = 0,
        rescue: bool = False,
        train_steps: int = 10_000,
        snapshot_every: int = 0,
        schedule: Mapping[float, str] | None = None,
        hold: int = HOLD,
        max_rescues: int = MAX_RESCUES,
        events: str | Path | Sink | None = None,
        log_fn: Callable[[str, float], None] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(
                f"Monitor watches a torch.nn.Module, got {type(model).__name__}; pass the model "
                "(for Keras, Lightning or the HF Trainer use their adapters in mixprec.monitor)."
            )
        if policy is not None and not isinstance(policy, Policy):
            raise UsageError(f"policy must be a mixprec Policy or None, got {type(policy).__name__}.")
        if policy is not None and scaler is not None:
            raise UsageError(
                "pass a policy or a plain loop's GradScaler, not both: the policy owns its scaler."
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise UsageError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}.")
        if getattr(model, "_mixprec_monitor", None) is not None:
            raise UsageError(
                "this model already has a mixprec Monitor; close() it first (one monitor per run)."
            )
        self.every = _positive_int("every", every)
        self.shadow_every = _positive_int("shadow_every", shadow_every, zero_ok=True)
        self.train_steps = _positive_int("train_steps", train_steps)
        self.snapshot_every = _positive_int("snapshot_every", snapshot_every, zero_ok=True)
        self.hold = _positive_int("hold", hold, zero_ok=True)
        self.max_rescues = _positive_int("max_rescues", max_rescues, zero_ok=True)
        self.model, self.policy, self.scaler, self.loss_fn = model, policy, scaler, loss_fn
        given = (
            [] if optimizer is None else list(optimizer if isinstance(optimizer, Sequence) else [optimizer])
        )
        self.optimizers = [_unwrapped(o) for o in given]
        self.rescue = bool(rescue)
        self.schedule = plan_schedule(schedule or {}, self.train_steps, policy)
        self.sinks: list[Sink] = []
        if isinstance(events, (str, Path)):
            self.sinks.append(JsonlSink(events))
        elif callable(events):
            self.sinks.append(events)
        elif events is not None:
            raise UsageError(f"events must be a path or a callable, got {type(events).__name__}.")
        self.log_fn = log_fn

        self.step = 0
        self.findings: list[Finding] = []
        self.losses: list[float] = []  # every step's loss, read at the sampled steps
        self.skipped: list[int] = []
        self.scales: list[tuple[int, float]] = []
        self.rescues = 0
        self._pending: list[torch.Tensor] = []
        self._last_action = -(10**9)
        self._seen: dict[tuple[str, str | None], int] = {}
        self._skips_before = policy.stats.skipped_steps if policy is not None else 0
        self._scale_before = self._read_scale()
        self._settled: float | None = None  # the scale level after start-up
        self._analysed_to = -1
        self._explained: set[int] = set()  # steps whose loss a finding has explained
        self._shadow_db: float | None = None
        self.rescuer = Rescuer(model, policy, self.optimizers)
        self._params_before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stalls: list[float] = []
        fmt = policy.spec.range_format if policy is not None else ("fp16" if scaler is not None else None)
        self.range_format = fmt if fmt in LOW_PRECISION_FORMATS else None
        self.recorder = StepRecorder(model, underflow_format=self.range_format)
        # half-precision weights (a *-true policy, or a model trained in bf16 by its framework):
        # their updates can round away
        self._half_weights = any(
            p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters() if p.requires_grad
        )
        # stalls are counted right after the optimizer step, while the gradients are still there
        # (the HF Trainer zeroes them before its callbacks run)
        self._hooks = [o.register_step_post_hook(lambda *_: self._count_stalls()) for o in self.optimizers]
        model._mixprec_monitor = self  # type: ignore[assignment]
        self._begin_sample(0)

    # ------------------------------------------------------------------ public
    def observe(self, loss: torch.Tensor | float, batch: Any = None) -> list[Finding]:
        """Record step ``self.step`` (call after the optimizer step); returns its new findings.

        ``batch``: the step's batch, for the fp32 shadow on a skipped step (kept only for this call)."""
        step, before = self.step, len(self.findings)
        sampled = step % self.every == 0
        skipped = self._skipped_now()
        if skipped:
            self.skipped.append(step)
        elif self._settled is None:
            self._settled = self._scale_before  # the level GradScaler's start-up found
        self._pending.append(loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss)))
        if sampled:
            self.recorder.end(self._scale_before if self.policy is None else self._read_scale())
            if skipped:
                self._params_before = []  # a skipped step moved nothing: no stall to count
            self._count_stalls()
        if skipped:
            self._on_skip(step, batch)
        elif (
            batch is not None
            and self.loss_fn is not None
            and isinstance(loss, torch.Tensor)
            and _on_host(loss)
        ):
            self._on_nonfinite(step, loss, batch)
        if self.shadow_every and step % self.shadow_every == 0 and batch is not None and self.loss_fn:
            self._shadow(step, batch)
        if sampled:
            self._analyse(step)
        name = self.schedule.get(step)
        if name is not None:
            done = self.rescuer.switch(name)
            self._emit(Finding(step, SCHEDULE, done, action=done))
        if self.snapshot_every and step % self.snapshot_every == 0:
            self.rescuer.take_snapshot(step)
        self.step += 1
        self._begin_sample(self.step)
        return self.findings[before:]

    def check_checkpoint(self) -> None:
        """Raise :class:`PoisonedCheckpointError` (and record a finding) when the weights or the
        optimizer state hold inf/NaN: a checkpoint now would poison every run resumed from it."""
        bad = nonfinite_state(self.model, self.optimizers)
        if bad is not None:
            self._emit(
                Finding(
                    self.step, CHECKPOINT_REFUSED, f"checkpoint refused: {bad} is not finite", _module_of(bad)
                )
            )
            raise PoisonedCheckpointError(
                f"checkpoint refused at step {self.step}: {bad} holds inf/NaN, and every run resumed "
                "from it would train on garbage; roll back (Monitor(snapshot_every=...)) or fix the "
                "precision first (the monitor's findings say where)."
            )

    def save(self, obj: Any, path: str | Path) -> None:
        """``torch.save(obj, path)`` after :meth:`check_checkpoint`."""
        self.check_checkpoint()
        torch.save(obj, path)

    def close(self) -> None:
        """Read the losses still on the device, remove the hooks and detach from the model."""
        self._read_losses()
        self.recorder.abandon()
        for hook in self._hooks:
            hook.remove()
        if getattr(self.model, "_mixprec_monitor", None) is self:
            del self.model._mixprec_monitor

    @property
    def healthy(self) -> bool:
        """No finding that blames the precision or the weights is left unanswered by a rescue."""
        acted = {f.step for f in self.findings if f.kind == RESCUE}
        open_ = [f for f in self.findings if f.kind in PRECISION_KINDS and not (f.action or f.step in acted)]
        return not open_ and all(math.isfinite(v) for v in self.losses[-1:])

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to judge as this one would: the step, the ranges and
        losses its trends and spike tests read, the scale it settled at, its findings and actions."""
        return {
            "step": self.step,
            "rescues": self.rescues,
            "last_action": self._last_action,
            "settled_scale": self._settled,
            "shadow_db": self._shadow_db,
            "analysed_to": self._analysed_to,
            "losses": list(self._read_losses()),
            "skipped": list(self.skipped),
            "stalls": list(self.stalls),
            "seen": [[kind, module, step] for (kind, module), step in self._seen.items()],
            "series": [s.to_dict() for s in self.recorder.series.values()],
            "recorded": self.recorder.steps,
            "findings": [f.to_dict() for f in self.findings],
            "policy": self.policy.config.to_dict() if self.policy is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (before the first :meth:`observe` of the resumed run)."""
        self.recorder.abandon()
        self.step = int(state["step"])
        self.rescues = int(state["rescues"])
        self._last_action = int(state.get("last_action", self._last_action))
        self._settled = state.get("settled_scale")
        self._shadow_db = state.get("shadow_db")
        self._analysed_to = int(state.get("analysed_to", self.step - 1))
        self.losses = [float(v) for v in state.get("losses") or []]
        self._pending = []
        self.skipped = [int(v) for v in state.get("skipped") or []]
        self.stalls = [float(v) for v in state.get("stalls") or []]
        self._seen = {(kind, module): int(step) for kind, module, step in state.get("seen") or []}
        self.recorder.series = {d["name"]: LayerSeries.from_dict(d) for d in state.get("series") or []}
        self.recorder.steps = int(state.get("recorded", 0))
        self.findings = [Finding(**f) for f in state.get("findings") or []]
        self._skips_before = self.policy.stats.skipped_steps if self.policy is not None else 0
        self._scale_before = self._read_scale()
        self._begin_sample(self.step)

    # ------------------------------------------------------------------ every step
    def _read_scale(self) -> float | None:
        if self.policy is not None:
            return self.policy.stats.scale
        if self.scaler is not None and self.scaler.is_enabled():
            return float(self.scaler.get_scale())  # its initial scale before the first step
        return None

    def _skipped_now(self) -> bool:
        """Whether this step was skipped. A policy counts its skips on the host; its scale (a device
        tensor) is read only when it matters: after a skip, until the scale settles, at sampled
        steps. A plain loop's skip shows as a lower scale, read from GradScaler after its
        ``step()`` has already synchronised (non-fused optimizers)."""
        if self.policy is not None:
            skipped = self.policy.stats.skipped_steps > self._skips_before
            self._skips_before = self.policy.stats.skipped_steps
            if self.policy.scaler is None:
                return skipped
            if not (skipped or self._settled is None or self.step % self.every == 0):
                return skipped
            scale = self.policy.stats.scale
        else:
            scale = self._read_scale()
            skipped = scale is not None and self._scale_before is not None and scale < self._scale_before
        if scale is not None:
            self.scales.append((self.step, scale))
        self._scale_before = scale
        return skipped

    def _begin_sample(self, step: int) -> None:
        if step % self.every:
            return
        self.recorder.begin()
        if self._half_weights:
            self._params_before = [
                (p, p.detach().clone()) for p in self.model.parameters() if p.requires_grad
            ]

    def _count_stalls(self) -> None:
        """The share of weights with a gradient that the step left bit-identical (*-true)."""
        if not self._params_before:
            return
        stalled = total = 0
        with torch.no_grad():
            for p, old in self._params_before:
                if p.grad is None:
                    continue
                moved = p.grad != 0
                stalled += int(((p.detach() == old) & moved).sum())
                total += int(moved.sum())
        self._params_before = []
        if total:
            self.stalls.append(stalled / total)

    # ------------------------------------------------------------------ skips
    def _on_skip(self, step: int, batch: Any) -> None:
        scale = self._scale_before
        if self._settled is None or scale is None:
            return  # GradScaler's start-up back-off: finding the scale, not a failure
        if scale >= self._settled:
            return  # a back-off after a growth, to the settled level: GradScaler's normal rhythm
        halvings = math.log2(self._settled / scale)
        if batch is not None and self.loss_fn is not None and self._blames_batch(step, batch):
            return
        module = self._locate(batch, scale * 2)
        if halvings >= COLLAPSE_HALVINGS:
            self._collapse(step, scale, halvings, module)
        elif self._new(OVERFLOW, module, step):
            where = f"first non-finite in {module!r}" if module else "module not located"
            self._act(
                Finding(
                    step,
                    OVERFLOW,
                    f"the step overflowed the policy's format ({where}); the loss scale fell "
                    f"to {scale:g}, {halvings:.0f} halvings below the level it had settled at",
                    module,
                    {"scale": scale, "settled_scale": self._settled},
                ),
                lambda: self.rescuer.island(module),
            )

    def _on_nonfinite(self, step: int, loss: torch.Tensor, batch: Any) -> None:
        """A non-finite loss the scaler did not skip (no scaler, or a finite gradient), read where the
        host already holds it (a CPU run: no sync; on a GPU it is seen at the next sampled step).
        Only that: a finite spike on a step that moved the weights cannot be shadowed, since the
        weights that made it are gone."""
        now = float(loss.detach().float().reshape(()))
        if math.isfinite(now) or self._blames_batch(step, batch):
            return
        self._explained.add(step)
        module = self._locate(batch, self._scale_before)
        if self._new(OVERFLOW, module, step):
            where = f"first non-finite in {module!r}" if module else "module not located"
            self._act(
                Finding(
                    step, OVERFLOW, f"the loss is {now} under the policy, finite in fp32 ({where})", module
                ),
                lambda: self.rescuer.island(module),
            )

    def _collapse(self, step: int, scale: float, halvings: float, module: str | None) -> None:
        if not self._new(SCALE_COLLAPSE, None, step):
            return
        finding = Finding(
            step,
            SCALE_COLLAPSE,
            f"the loss scale fell {halvings:.0f} halvings, to {scale:g}: gradients overflow at any scale"
            + (f" (first non-finite in {module!r})" if module else ""),
            module,
            {"scale": scale, "settled_scale": self._settled},
        )
        self._act(finding, self.rescuer.to_bf16)

    def _weights_poisoned(self, step: int) -> bool:
        """Whether weights or optimizer state hold inf/NaN (a finding, and a roll-back to rescue)."""
        bad = nonfinite_state(self.model, self.optimizers)
        if bad is None:
            return False
        self._explained.add(step)
        if self._new(NONFINITE_WEIGHTS, _module_of(bad), step):
            finding = Finding(step, NONFINITE_WEIGHTS, f"{bad} holds inf/NaN", _module_of(bad))
            self._act(finding, self.rescuer.roll_back)
        return True

    def _blames_batch(self, step: int, batch: Any) -> bool:
        """Whether the trouble is not the precision's: poisoned weights (a finding of their own), or
        an fp32 shadow that shows it too (a non-finite or spiking loss: the data)."""
        assert self.loss_fn is not None
        if self._weights_poisoned(step):
            return True
        try:
            shadow = fp32_loss(self.model, self.loss_fn, batch)
        except Exception as exc:  # the shadow is evidence; its failure must not stop the run
            log.debug("fp32 shadow failed: %s", exc)
            return False
        recent = [v for v in self._read_losses()[-RECENT - 1 : -1] if math.isfinite(v)]
        spike = len(recent) >= 5 and _spikes(shadow, recent)
        if math.isfinite(shadow) and not spike:
            return False
        self._explained.add(step)
        if not self._new(BAD_BATCH, None, step):
            return True
        skipped = "the step was skipped, " if self.skipped and self.skipped[-1] == step else ""
        self._emit(
            Finding(
                step,
                BAD_BATCH,
                f"the fp32 shadow of this batch {'spikes too' if math.isfinite(shadow) else 'is not finite'} "
                f"(loss {shadow:.4g}): the data, not the precision; {skipped}the policy is not blamed",
                None,
                {"fp32_loss": shadow, "recent_median": statistics.median(recent) if recent else None},
            )
        )
        return True

    def _locate(self, batch: Any, scale: float | None) -> str | None:
        """The first module whose output or gradient is non-finite on ``batch`` under the policy."""
        if batch is not None and self.loss_fn is not None:
            grads = {p: p.grad for p in self.model.parameters()}
            try:
                autocast = (
                    self.policy.autocast()
                    if self.policy is not None
                    else torch.autocast(next(self.model.parameters()).device.type, dtype=torch.float16)
                )
                fn = self.loss_fn

                def step() -> torch.Tensor:
                    with autocast:
                        return fn(self.model, batch)

                report = collect_ranges(self.model, step, loss_scale=scale)
                return report.first_nonfinite_forward or report.first_nonfinite_backward
            except Exception as exc:
                log.debug("locating the overflow failed: %s", exc)
            finally:
                for p, g in grads.items():
                    p.grad = g
        names = self.policy.stats.last_nonfinite_params if self.policy is not None else []
        return _module_of(names[-1]) if names else None  # the last parameter: nearest the output

    # ------------------------------------------------------------------ sampled steps
    def _read_losses(self) -> list[float]:
        if self._pending:
            self.losses += [
                float(v) for v in torch.stack([t.float().reshape(()) for t in self._pending]).cpu()
            ]
            self._pending = []
        return self.losses

    def _analyse(self, step: int) -> None:
        losses = self._read_losses()
        if self.log_fn is not None and losses:
            self.log_fn("mixprec/loss_scale", self.scales[-1][1] if self.scales else float("nan"))
        fresh = losses[len(losses) - (step - self._analysed_to) :] if step > self._analysed_to else []
        start = step - len(fresh) + 1
        # a skipped step's loss was judged by the skip, and a step with a finding by that finding
        skipped = set(self.skipped) | self._explained
        first_bad = next(
            (i for i, v in enumerate(fresh) if not math.isfinite(v) and start + i not in skipped), None
        )
        self._analysed_to = step
        if self._weights_poisoned(step):  # (the non-finite losses since are its consequence)
            return
        islands = [n for n, m in self.model.named_modules() if getattr(m, "_fp32_island", False)]
        # an fp32 island's own ranges are fp32's: they cannot overflow the policy's format
        series = [s for s in self.recorder.series.values() if not is_fp32_island(s.name, islands)]
        if first_bad is not None:
            at = start + first_bad
            infinite = [s.name for s in series if s.forward and math.isinf(s.forward[-1])]
            # the module that made the inf: none of its submodules' outputs is infinite
            module = next((n for n in infinite if not any(m.startswith(n + ".") for m in infinite)), None)
            where = f"first infinite output in {module!r}"
            if module is None and self.range_format is not None and series:
                # this sampled step stayed finite: the layer that came closest to the limit
                module = least_headroom(series, self.range_format, n=1)[0]["layer"]
                where = f"no infinite output at the sampled step; closest to the limit: {module!r}"
            if self._new(OVERFLOW, module, step):
                self._act(
                    Finding(
                        step,
                        OVERFLOW,
                        f"the loss is not finite since step {at} ({where})",
                        module,
                        {"first_nonfinite_loss_step": at},
                    ),
                    lambda: self.rescuer.island(module),
                )
            return
        if self.range_format is not None:
            # the trend of the last WINDOW samples: a long run's early ranges say little about now,
            # and the fit's cost must not grow with the run
            offset = max(0, self.recorder.steps - WINDOW)
            window = [
                LayerSeries(s.name, s.type, s.forward[offset:], s.backward[offset:], s.underflow[offset:])
                for s in series
            ]
            samples_left = max(1, self.train_steps // self.every - offset)
            seen = outlook(window, self.range_format, samples_left, start=0 if offset else 1).at_risk
            if seen is not None and seen.step is not None:
                kind = UNDERFLOW if seen.direction == "underflow" else PREDICTED_OVERFLOW
                at = (offset + seen.step) * self.every
                if self._new(kind, seen.layer, step):
                    text = seen.describe(self.train_steps)
                    text = text.replace(f"at about step {seen.step} of", f"at about step {at} of")
                    text = text.replace("bits/step", f"bits per {self.every} steps")
                    layer = seen.layer
                    self._act(
                        Finding(
                            step,
                            kind,
                            text,
                            layer,
                            {"predicted_step": at, "headroom_bits": seen.headroom_bits},
                        ),
                        lambda: self.rescuer.island(layer),
                    )
        if self.stalls:
            now = self.stalls[-1]
            offset = max(0, len(self.stalls) - WINDOW)
            p = predict(
                self.stalls[offset:], STALL_LIMIT, layer="all weights", direction="updates", fmt="storage"
            )
            growing = p is not None and p.trending and p.within_evidence and p.step is not None
            if (now > STALL_LIMIT or growing) and self._new(STALL, None, step):
                self._emit(
                    Finding(
                        step,
                        STALL,
                        f"{now:.1%} of the weight updates rounded away at this step"
                        + (
                            f", predicted to pass {STALL_LIMIT:.0%} at about step "
                            f"{(offset + (p.step or 0)) * self.every}"
                            if growing and p is not None and now <= STALL_LIMIT
                            else ""
                        )
                        + "; half-precision weights cannot be rescued live: rerun with the *-mixed policy",
                        None,
                        {"stalled_fraction": now},
                    )
                )

    def _shadow(self, step: int, batch: Any) -> None:
        assert self.loss_fn is not None
        autocast = self.policy.autocast if self.policy is not None else None
        try:
            sqnr = shadow_sqnr(self.model, self.loss_fn, batch, autocast, self._scale_before)
        except Exception as exc:
            log.debug("shadow step failed: %s", exc)
            return
        if sqnr is None:
            return
        if self._shadow_db is None:
            self._shadow_db = sqnr  # the noise floor of this policy on this model, at start-up
            return
        if sqnr < self._shadow_db - DRIFT_DB and self._new(DRIFT, None, step):
            self._emit(
                Finding(
                    step,
                    DRIFT,
                    f"gradient SQNR against the fp32 shadow fell to {sqnr:.1f} dB "
                    f"(start-up: {self._shadow_db:.1f} dB)",
                    None,
                    {"grad_sqnr_db": sqnr},
                )
            )

    # ------------------------------------------------------------------ actions
    def _new(self, kind: str, module: str | None, step: int) -> bool:
        """The same finding again within ``hold`` steps is not news."""
        last = self._seen.get((kind, module))
        if last is not None and step - last < max(self.hold, 1):
            return False
        self._seen[(kind, module)] = step
        return True

    def _act(self, finding: Finding, action: Callable[[], str]) -> None:
        self._emit(finding)
        if not self.rescue:
            return
        if finding.step - self._last_action < self.hold:
            return  # let the last action show its effect first
        if self.rescues >= self.max_rescues:
            raise MonitorStop(
                f"step {finding.step}: {finding.kind} ({finding.message}) after {self.rescues} rescues "
                f"(max_rescues={self.max_rescues}): the run is stopped rather than trained on garbage; "
                f"the findings so far are in the monitor's events."
            )
        done = action()
        if done:
            self.rescues += 1
            self._last_action = finding.step
            self._emit(
                Finding(finding.step, RESCUE, done, finding.module, {"answers": finding.kind}, action=done)
            )

    def _emit(self, finding: Finding) -> None:
        self.findings.append(finding)
        log.warning(finding.line())
        for sink in self.sinks:
            sink(finding)
        if self.log_fn is not None:
            self.log_fn(f"mixprec/{finding.kind}", float(finding.step))
