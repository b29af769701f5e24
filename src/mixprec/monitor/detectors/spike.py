"""Loss and gradient-norm spikes (``spike``), found as they happen and diagnosed before their update
lands.

A spike is judged against the run's own range, not a fixed threshold: the median and MAD of the
log of the first :data:`WARMUP` values, then running averages of the log and of its absolute
deviation (:class:`Level`); a value :data:`SPIKE_MADS` deviations above (and at least
:data:`MIN_RATIO` times the running level) is one, and so is a non-finite one. On a step that is
not a spike this is a few float operations on a value the host already holds.

The spike is visible after the backward and before the optimizer applies the update (the loop hands
the loss and batch over with :meth:`~mixprec.monitor.Monitor.before_step`; the adapters and ``mixprec
train`` do). Its batch is replayed from the same weights, in strict fp32 and once more in the policy:

========== ===================================== ==============================================
verdict    the replay                            with ``rescue=True``
========== ===================================== ==============================================
data       fp32 spikes too: the batch            the update is withheld (as an overflow skip),
                                                 the batch added to the skip list
precision  fp32 is fine, the policy spikes again the module becomes an fp32 island (the first
                                                 non-finite one, as the overflow path names it);
                                                 the update is withheld. A non-finite value is an
                                                 ``overflow`` finding, as the overflow path's
transient  neither spikes: it did not reproduce  retried once: the update is the replay's
undiagnosed no replay from the same weights      nothing (no batch given, or found only after
                                                 the update landed)
========== ===================================== ==============================================

Without ``rescue`` each is an alert and the run is not healthy (``mixprec train`` exits 4). Where it
came from: Lightning's ``SpikeDetection`` (skip the batch, ``skip_batches.json``), Megatron-LM's rerun
state machine (a loss 10x its tracked maximum is a spike; re-run the step to tell a transient fault
from a reproducible one), and pytorch/torchtitan#916 (diagnose, do not skip blindly); the fp32
replay that separates the data from the precision is the monitor's shadow.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.detectors.bad_batch import DIVERGED_WHY, InARow
from mixprec.monitor.detectors.base import Detector, Run, UpdateView
from mixprec.monitor.findings import (
    DATA,
    DIVERGED,
    DIVERGENCE,
    OVERFLOW,
    PRECISION,
    SPIKE,
    TRANSIENT,
    UNDIAGNOSED,
    MonitorFinding,
)
from mixprec.monitor.rescue import nonfinite_state
from mixprec.monitor.shadow import Replay, control_fails, first_nonfinite, replay

log = logging.getLogger("mixprec.monitor")

WARMUP = 50  # values before the range is set (the median and MAD of their log)
ALPHA = 0.02  # weight of a new value in the running averages (about the last 50)
SPIKE_MADS = 10.0  # deviations of the log above the running level that make a spike
MIN_RATIO = 4.0  # and at least this many times the running level
MIN_DEVIATION = 0.02  # a floor under the deviation of a series that barely moves
RECENT = 64  # values the range in a finding's evidence is read from
CONSECUTIVE = 3  # spikes in a row beyond which the level has moved: learnt again, not a spike
_LOG_MIN_RATIO = math.log(MIN_RATIO)
_LOG_MAX = math.log(sys.float_info.max)


class Level:
    """The running range of one positive series (the loss, the gradient norm) in log space.
    ``recent``: keep the latest values for a finding's evidence (the loss's are the run's own)."""

    def __init__(self, recent: bool = False) -> None:
        self.keep = recent
        self.reset()

    def reset(self) -> None:
        """Nothing learnt yet: the warm-up starts again."""
        self.warm: list[float] = []  # the log values of the warm-up
        self.mean: float | None = None  # the running level of the log (None during the warm-up)
        self.dev = 0.0  # the running absolute deviation of the log
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.run = 0  # spikes in a row
        self.off = False  # a value < 0 was seen: not a positive series, not judged
        self.log_limit = math.inf  # the log of the value above which a value is a spike

    def limit(self) -> float | None:
        """The value above which a value is a spike (None during the warm-up)."""
        return None if self.log_limit == math.inf else math.exp(self.log_limit)

    def spikes(self, value: float) -> bool:
        """Above the limit, or not finite (at any step)."""
        if 0.0 < value < math.inf:
            return math.log(value) > self.log_limit
        return not math.isfinite(value)

    def take(self, value: float) -> bool:
        """Whether ``value`` is a spike; one that is not joins the range (the hot path of every step:
        a log, a comparison and two running averages)."""
        if 0.0 < value < math.inf:
            x = math.log(value)
            if x > self.log_limit:
                return True
            self.run = 0
            if self.keep:
                self.recent.append(value)
            mean = self.mean
            if mean is None:
                self.warm.append(x)
                if len(self.warm) >= WARMUP:
                    self._learnt()
                return False
            mean += ALPHA * (x - mean)
            dev = self.dev + ALPHA * (abs(x - mean) - self.dev)
            self.mean, self.dev = mean, dev if dev > MIN_DEVIATION else MIN_DEVIATION
            self.log_limit = mean + max(_LOG_MIN_RATIO, SPIKE_MADS * self.dev)
            return False
        if value == 0.0 or (value < 0.0 and value > -math.inf):
            if value < 0.0:
                self.off, self.log_limit = True, math.inf  # a loss that can be negative: no log range
            self.run = 0
            return False
        return True  # not finite

    def _learnt(self) -> None:
        """The warm-up is over: the median and MAD of its logs set the level."""
        self.mean = statistics.median(self.warm)
        self.dev = max(statistics.median(abs(v - self.mean) for v in self.warm), MIN_DEVIATION)
        self.warm = []
        if not self.off:
            self.log_limit = self.mean + max(_LOG_MIN_RATIO, SPIKE_MADS * self.dev)

    def moved(self, value: float) -> bool:
        """Count a spike; past :data:`CONSECUTIVE` in a row the level has moved (a new regime, not
        a spike): the range is learnt again from here."""
        self.run += 1
        if self.run <= CONSECUTIVE or not math.isfinite(value):
            return False
        self.reset()
        self.take(value)
        return True

    def range(self) -> list[float] | None:
        return [min(self.recent), max(self.recent)] if self.recent else None

    def state_dict(self) -> dict[str, Any]:
        return {"warm": list(self.warm), "mean": self.mean, "dev": self.dev, "recent": list(self.recent),
                "off": self.off}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reset()
        self.warm = [float(v) for v in state.get("warm") or []]
        self.mean = state.get("mean")
        self.dev = float(state.get("dev") or 0.0)
        self.recent = deque((float(v) for v in state.get("recent") or []), maxlen=RECENT)
        self.off = bool(state.get("off"))
        if self.mean is not None and not self.off:
            self.log_limit = self.mean + max(_LOG_MIN_RATIO, SPIKE_MADS * self.dev)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


class Spike(Detector):
    """Spikes in the loss and the gradient norm, diagnosed by replaying the batch."""

    kinds = (SPIKE, OVERFLOW)

    def __init__(self, config: MonitorConfig) -> None:
        super().__init__(config)
        self.loss = Level()  # (the range in a finding's evidence is read from the run's losses)
        self.grad = Level(recent=True)
        self.taken: set[int] = set()  # steps on_update took (joined or judged): not fed again
        self.quiet_below = sys.float_info.max  # the warm-up: only a non-finite loss is a spike
        self.data_in_a_row = InARow()  # data verdicts in a row: a broken pipeline stops the run
        self.diverged_in_a_row = InARow()  # weights that fail on any batch, in a row: the run diverges

    def _refresh(self) -> None:
        """The quick test's limit: the loss level's (a loss above it, or not finite, is looked at)."""
        limit = self.loss.log_limit
        self.quiet_below = math.exp(limit) if limit < _LOG_MAX else sys.float_info.max

    # ------------------------------------------------------------------ before the update
    def on_update(self, run: Run, view: UpdateView) -> bool:
        """A step the quick test did not clear (a loss above :attr:`quiet_below` or not finite, or a
        gradient norm to test): a spike is diagnosed from the same weights before its update."""
        self.taken.add(view.step)
        loss, norm = view.loss, view.grad_norm
        in_loss = loss is not None and self.loss.take(loss)
        in_grad = norm is not None and self.grad.take(norm)
        self._refresh()
        if not (in_loss or in_grad) or self._moved(view, in_loss, in_grad):
            return False
        if nonfinite_state(run.model, run.optimizers) is not None:
            return False  # poisoned weights, not the batch or the precision: PoisonedWeights' finding
        evidence = self._evidence(run, view, in_loss, in_grad)
        if view.batch is None or run.loss_fn is None:
            self._report(run, view, UNDIAGNOSED, evidence, "no batch to replay (pass it to before_step)")
            return True
        try:
            verdict, module, why, replays = self._diagnose(run, view, in_loss, in_grad)
        except MixprecError:
            raise
        except Exception as exc:  # a replay is evidence: a loss_fn that fails on it must not stop the run
            log.debug("replaying the spike's batch failed: %s", exc)
            self._report(run, view, UNDIAGNOSED, evidence, f"its replay failed ({type(exc).__name__}: {exc})")
            return True
        evidence.update(replays)
        self._report(run, view, verdict, evidence, why, module, replays)
        return True

    def _diagnose(
        self, run: Run, view: UpdateView, in_loss: bool, in_grad: bool
    ) -> tuple[str, str | None, str, dict[str, Any]]:
        """The batch replayed from the same weights: in strict fp32 (forward only for a loss spike),
        then, unless fp32 spikes too, in the policy (forward and backward: its gradients are the
        retry's)."""
        loss_fn = run.loss_fn
        assert loss_fn is not None  # (a spike with a batch and no loss_fn is reported undiagnosed)
        fp32 = replay(run.model, loss_fn, view.batch, None, fp32=True, backward=in_grad)
        replays: dict[str, Any] = {"fp32_loss": fp32.loss, "fp32_grad_norm": fp32.grad_norm}
        if self._again(fp32, in_loss, in_grad):
            control = control_fails(run.model, loss_fn, run.control_batch, view.batch, self.loss.spikes)
            if control is not None:
                replays["control_fp32_loss"] = control
                return (
                    DIVERGED,
                    None,
                    f"replayed in fp32 from the same weights it spikes too (loss {fp32.loss:.4g}), and so "
                    f"does a batch whose loss was normal (loss {control:.4g}): the weights fail on any "
                    "batch, in strict fp32 too: the run diverges, whatever the precision and the data",
                    replays,
                )
            return (
                DATA,
                None,
                f"replayed in fp32 from the same weights it spikes too (loss {fp32.loss:.4g})",
                replays,
            )
        scale = run.scale.current
        policy = replay(run.model, loss_fn, view.batch, run.autocast, scale=scale, keep_grads=True)
        replays.update(policy_loss=policy.loss, policy_grad_norm=policy.grad_norm)
        self._retry = policy.grads
        if self._again(policy, in_loss, in_grad):
            module = None
            if not (math.isfinite(policy.loss) and math.isfinite(policy.grad_norm or 0.0)):
                module = first_nonfinite(run.model, loss_fn, view.batch, run.autocast(), scale)
            where = f"first non-finite in {module!r}" if module else "module not located"
            why = (
                f"fp32 is fine (loss {fp32.loss:.4g}) and the policy spikes again (loss {policy.loss:.4g}; "
                f"{where})"
            )
            return PRECISION, module, why, replays
        device = next(run.model.parameters()).device
        why = (
            f"replayed from the same weights it does not spike (fp32 loss {fp32.loss:.4g}, policy "
            f"{policy.loss:.4g}): a fault that does not reproduce"
        )
        if device.type == "cuda":
            why += (
                f" on this GPU ({device}): a transient hardware fault or a non-deterministic kernel; "
                "if it recurs, re-run the step on another GPU to tell which (as Megatron's rerun "
                "machine does)"
            )
        return TRANSIENT, None, why, replays

    def _again(self, r: Replay, in_loss: bool, in_grad: bool) -> bool:
        """Whether a replay shows the spike again (a value the run's range calls a spike)."""
        if in_loss and self.loss.spikes(r.loss):
            return True
        return in_grad and r.grad_norm is not None and self.grad.spikes(r.grad_norm)

    def _report(
        self,
        run: Run,
        view: UpdateView,
        verdict: str,
        evidence: dict[str, Any],
        why: str,
        module: str | None = None,
        replays: dict[str, Any] | None = None,
    ) -> None:
        evidence["verdict"] = verdict
        what = evidence["in"]
        values = f"loss {_figure(evidence.get('loss'))}" if "loss" in what else ""
        if "grad_norm" in what:
            values += (", " if values else "") + f"gradient norm {_figure(evidence.get('grad_norm'))}"
        ranges = evidence.get("loss_range") if "loss" in what else evidence.get("grad_norm_range")
        seen = f" against the run's {ranges[0]:.3g}..{ranges[1]:.3g}" if ranges else ""
        batch = f", batch {evidence['batch_index']}" if evidence.get("batch_index") is not None else ""
        message = f"{verdict}: {values}{seen}{batch}; {why}"
        # a non-finite value the precision makes is an overflow, as the overflow path calls it (and,
        # as there, the same module's within ``hold`` steps is no news: it persists until rescued)
        finite = all(
            math.isfinite(v) for v in (evidence.get("loss") or 0.0, evidence.get("grad_norm") or 0.0)
        )
        kind = SPIKE if verdict != PRECISION or finite else OVERFLOW
        kind = DIVERGENCE if verdict == DIVERGED else kind
        finding = MonitorFinding(view.step, kind, message, module, evidence)
        rescuer = run.rescuer
        index = evidence.get("batch_index")
        if verdict == DIVERGED:  # its update withheld, as a bad batch's; stopped when it persists
            run.report(finding, local=rescuer.withhold, dedupe=False)
            self.diverged_in_a_row.stop_if_broken(run, finding, skipped=False, why=DIVERGED_WHY)
        elif verdict == DATA:
            run.report(
                finding,
                local=lambda: rescuer.withhold(skip=view.step if index is None else index),
                dedupe=False,
            )
            self.data_in_a_row.stop_if_broken(run, finding, skipped=False)
        elif verdict == PRECISION:
            run.report(
                finding, rescuer.action("island", module), local=rescuer.withhold, dedupe=kind == OVERFLOW
            )
        elif verdict == TRANSIENT:
            grads, self._retry = self._retry, None
            if run.data_parallel:
                # over data-parallel ranks the replay's gradients are this rank's alone (never
                # all-reduced): a retry would part the replicas, so the update is withheld on all
                run.report(finding, local=rescuer.withhold, dedupe=False)
            else:
                run.report(finding, local=lambda: rescuer.retry(grads), dedupe=False)
        else:
            run.report(finding, dedupe=False)

    def _evidence(self, run: Run, view: UpdateView, in_loss: bool, in_grad: bool) -> dict[str, Any]:
        recent = [v for v in run.read_losses()[-RECENT:] if math.isfinite(v)]
        if view.landed and recent:
            recent = recent[:-1]  # (after the step the run's losses hold this one already)
        return {
            "in": "loss and grad_norm" if in_loss and in_grad else "loss" if in_loss else "grad_norm",
            "loss": view.loss,
            "loss_range": [min(recent), max(recent)] if recent else None,
            "loss_limit": self.loss.limit(),
            "grad_norm": view.grad_norm,
            "grad_norm_range": self.grad.range(),
            "grad_norm_limit": self.grad.limit(),
            "batch_index": view.batch_index,
        }

    def _moved(self, view: UpdateView, in_loss: bool, in_grad: bool) -> bool:
        moved = in_loss and view.loss is not None and self.loss.moved(view.loss)
        if in_grad and view.grad_norm is not None:
            moved = self.grad.moved(view.grad_norm) or moved
        return moved

    # ------------------------------------------------------------------ the range, and late spikes
    def on_losses(self, run: Run, start: int, losses: Sequence[float], judged: set[int]) -> None:
        """The losses join the range in batches (a hot loop: a normal step's only work before its
        update is the quick test). One no check before its update saw (the loop handed nothing over
        with Monitor.before_step: on a GPU its losses are read at the sampled steps only) and that
        spikes is reported, undiagnosed: its update has landed, and the weights that made it are
        gone. A non-finite one is the overflow path's, as before."""
        end = start + len(losses)
        for step, value in enumerate(losses, start):
            if step in self.taken or step in judged or not self.loss.take(value):
                continue
            if not math.isfinite(value) or self.loss.moved(value):
                continue
            late = UpdateView(step, value, None, None, None, landed=True)
            why = (
                "found after its update landed, so no replay from the weights that made it: hand the "
                "loss and batch over before the optimizer step (Monitor.before_step: one read of the loss "
                "a step on a GPU) to have it diagnosed and withheld"
            )
            self._report(run, late, UNDIAGNOSED, self._evidence(run, late, True, False), why)
        self.taken = {s for s in self.taken if s >= end}
        self._refresh()

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        return {"spike_loss": self.loss.state_dict(), "spike_grad_norm": self.grad.state_dict(),
                "spike_taken": sorted(self.taken),
                "spike_data_in_a_row": self.data_in_a_row.state_dict()}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loss.load_state_dict(state.get("spike_loss") or {})
        self.grad.load_state_dict(state.get("spike_grad_norm") or {})
        self.taken = {int(s) for s in state.get("spike_taken") or []}
        self.data_in_a_row.load_state_dict(state.get("spike_data_in_a_row"))
        self._refresh()

    _retry: list[torch.Tensor | None] | None = None
