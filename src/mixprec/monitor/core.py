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
from mixprec.monitor.judge import STALL_LIMIT, WINDOW, culprit, range_risk, stall
from mixprec.monitor.rescue import Rescuer, nonfinite_state, plan_schedule
from mixprec.monitor.sampler import Sampler
from mixprec.monitor.scale import ScaleWatch
from mixprec.monitor.shadow import first_nonfinite, fp32_loss, shadow_sqnr
from mixprec.numerics.limits import LOW_PRECISION_FORMATS
from mixprec.policy import Policy
from mixprec.policy.islands import is_fp32_island

log = logging.getLogger("mixprec.monitor")

# A skip that drops the scale this many halvings below the level the run settled at, in a row of
# skips, is a collapse (GradScaler's own floor, min_scale, would stop the run a few skips later).
COLLAPSE_HALVINGS = 6
# A loss this many median absolute deviations above the recent median is a spike.
SPIKE_MADS = 10.0
RECENT = 50  # losses the spike test compares with
DRIFT_DB = 20.0
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
        every: steps between sampled steps (ranges, losses, trends, weight checks); None: 100, or
            less often where sampled steps would cost more than 0.25% of the run's time (see
            :mod:`mixprec.monitor.sampler`).
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
        every: int | None = None,
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
        if every is not None:
            _positive_int("every", every)
        self.shadow_every = _positive_int("shadow_every", shadow_every, zero_ok=True)
        self.train_steps = _positive_int("train_steps", train_steps)
        self.snapshot_every = _positive_int("snapshot_every", snapshot_every, zero_ok=True)
        self.hold = _positive_int("hold", hold, zero_ok=True)
        self.max_rescues = _positive_int("max_rescues", max_rescues, zero_ok=True)
        self.model, self.policy, self.loss_fn = model, policy, loss_fn
        self.scale = ScaleWatch(policy, scaler)
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
        self.rescues = 0
        self._pending: list[torch.Tensor] = []  # device losses, read at the next sampled step
        self._host: bool | None = None  # whether the loss is on the host (read each step, no sync)
        self._last_action = -(10**9)
        self._seen: dict[tuple[str, str | None], int] = {}
        self._analysed_to = -1
        self._explained: set[int] = set()  # steps whose loss a finding has explained
        self._shadow_db: float | None = None
        self.rescuer = Rescuer(model, policy, self.optimizers)
        fmt = policy.spec.range_format if policy is not None else ("fp16" if scaler is not None else None)
        self.range_format = fmt if fmt in LOW_PRECISION_FORMATS else None
        self.sampler = Sampler(model, self.range_format, every)
        # stalls are counted right after the optimizer step, while the gradients are still there
        count = lambda *_: self.sampler.count_stalls(self.step)  # noqa: E731
        self._hooks = [o.register_step_post_hook(count) for o in self.optimizers]
        model._mixprec_monitor = self  # type: ignore[assignment]
        self.sampler.begin(0)

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

    # ------------------------------------------------------------------ public
    def observe(self, loss: torch.Tensor | float, batch: Any = None) -> list[Finding]:
        """Record step ``self.step`` (call after the optimizer step); returns its new findings.

        ``batch``: the step's batch, for the fp32 shadow on a skipped step (kept only for this call)."""
        step, before = self.step, len(self.findings)
        sampled = step % self.sampler.interval == 0
        skipped = self.scale.after_step(step, sampled)
        value = self._keep_loss(loss)
        if sampled:
            self.sampler.end(step, self.scale.current if self.policy is None else self.scale.read(), skipped)
        if skipped:
            self._on_skip(step, batch)
        elif value is not None and not math.isfinite(value) and batch is not None and self.loss_fn:
            self._on_nonfinite(step, value, batch)
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
        self.sampler.next(self.step)
        return self.findings[before:]

    def _keep_loss(self, loss: torch.Tensor | float) -> float | None:
        """Keep the step's loss: its value where the host holds it already (a CPU run: no sync, so
        a non-finite loss is seen at once), else the device tensor, read at the next sampled step."""
        if isinstance(loss, torch.Tensor):
            if self._host is None:
                self._host = loss.device.type == "cpu" and loss.numel() == 1
            if not self._host:
                self._pending.append(loss.detach())
                return None
            value = loss.item()
        else:
            value = float(loss)
        if self._pending:
            self._read_losses()  # (the order of the losses is kept)
        self.losses.append(value)
        return value

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
        self.sampler.abandon()
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
            "shadow_db": self._shadow_db,
            "analysed_to": self._analysed_to,
            "losses": list(self._read_losses()),
            **self.scale.state_dict(),
            "seen": [[kind, module, step] for (kind, module), step in self._seen.items()],
            "sampler": self.sampler.state_dict(),
            "findings": [f.to_dict() for f in self.findings],
            "policy": self.policy.config.to_dict() if self.policy is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (before the first :meth:`observe` of the resumed run)."""
        self.step = int(state["step"])
        self.rescues = int(state["rescues"])
        self._last_action = int(state.get("last_action", self._last_action))
        self._shadow_db = state.get("shadow_db")
        self._analysed_to = int(state.get("analysed_to", self.step - 1))
        self.losses = [float(v) for v in state.get("losses") or []]
        self._pending = []
        self._seen = {(kind, module): int(step) for kind, module, step in state.get("seen") or []}
        self.sampler.load_state_dict(state.get("sampler") or {})
        self.findings = [Finding(**f) for f in state.get("findings") or []]
        self.scale.load_state_dict(dict(state))
        self.sampler.begin(self.step)

    # ------------------------------------------------------------------ every step
    # ------------------------------------------------------------------ skips
    def _on_skip(self, step: int, batch: Any) -> None:
        scale = self.scale.current
        if self.scale.settled is None or scale is None or self.scale.starting(step):
            return  # GradScaler's start-up back-off: finding the scale, not a failure
        if scale >= self.scale.settled:
            return  # a back-off after a growth, to the settled level: GradScaler's normal rhythm
        halvings = math.log2(self.scale.settled / scale)
        if batch is not None and self.loss_fn is not None and self._blames_batch(step, batch):
            return
        if step - 1 not in self.scale.skipped[-2:] and halvings < COLLAPSE_HALVINGS:
            # one skip the next step does not repeat: the scaler backed off to fit gradients that
            # grew (its job; a timm ViT in fp16 did so three times in 2,000 steps). An overflow the
            # precision causes persists at any scale: it skips again, and that is the finding.
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
                    {"scale": scale, "settled_scale": self.scale.settled},
                ),
                lambda: self.rescuer.island(module),
            )

    def _on_nonfinite(self, step: int, now: float, batch: Any) -> None:
        """A non-finite loss the scaler did not skip (no scaler, or a finite gradient), read where the
        host already holds it (a CPU run: no sync; on a GPU it is seen at the next sampled step).
        Only that: a finite spike on a step that moved the weights cannot be shadowed, since the
        weights that made it are gone."""
        if self._blames_batch(step, batch):
            return
        self._explained.add(step)
        module = self._locate(batch, self.scale.current)
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
            {"scale": scale, "settled_scale": self.scale.settled},
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
        """The first module whose output or gradient is non-finite on ``batch`` under the policy
        (a plain loop: fp16 autocast); without the batch, the policy's last non-finite gradient."""
        if batch is not None and self.loss_fn is not None:
            device = next(self.model.parameters()).device.type
            autocast = self.policy.autocast() if self.policy else torch.autocast(device, dtype=torch.float16)
            try:
                return first_nonfinite(self.model, self.loss_fn, batch, autocast, scale)
            except Exception as exc:  # evidence only: its failure must not stop the run
                log.debug("locating the overflow failed: %s", exc)
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
        series = [s for s in self.sampler.recorder.series.values() if not is_fp32_island(s.name, islands)]
        if first_bad is not None:
            at = start + first_bad
            module, where = culprit(series, self.range_format)
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
            window, first = self.sampler.window(WINDOW)
            window = [s for s in window if not is_fp32_island(s.name, islands)]
            risk = range_risk(window, first, self.every, self.range_format, self.train_steps)
            if risk is not None:
                kind = UNDERFLOW if risk.direction == "underflow" else PREDICTED_OVERFLOW
                if self._new(kind, risk.layer, step):
                    layer = risk.layer
                    self._act(
                        Finding(
                            step,
                            kind,
                            risk.message,
                            layer,
                            {"predicted_step": risk.step, "headroom_bits": risk.headroom_bits},
                        ),
                        lambda: self.rescuer.island(layer),
                    )
        seen = stall(self.sampler.stalls, self.every)
        if seen is not None and self._new(STALL, None, step):
            when = (
                f", predicted to pass {STALL_LIMIT:.0%} at about step {seen.predicted_step}"
                if seen.predicted_step is not None
                else ""
            )
            self._act(
                Finding(
                    step,
                    STALL,
                    f"{seen.fraction:.1%} of the weight updates rounded away at this step{when}: the "
                    "half weights cannot hold them; fp32 master weights can (the *-mixed policy, live "
                    "with rescue=True)",
                    None,
                    {"stalled_fraction": seen.fraction},
                ),
                self.rescuer.master_weights,
            )

    def _shadow(self, step: int, batch: Any) -> None:
        assert self.loss_fn is not None
        autocast = self.policy.autocast if self.policy is not None else None
        try:
            sqnr = shadow_sqnr(self.model, self.loss_fn, batch, autocast, self.scale.current)
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
