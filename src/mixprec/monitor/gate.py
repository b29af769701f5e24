"""The update gate of a :class:`~mixprec.monitor.Monitor`, between the loop's backward and its
optimizer step and right after it. Where the loop hands its loss and batch over
(:meth:`Monitor.before_step <mixprec.monitor.Monitor.before_step>`; the adapters and ``mixprec
train`` do), the spike test of the loss (and gradient norm) against the run's own range is a few
float operations on a value the host holds; on a spike, its batch replayed from the same weights in
fp32 and in the policy says data, precision or transient, and the update is withheld, rescued or
retried before it lands (:mod:`~mixprec.monitor.detectors.spike`). A step whose loss the quick
test read and cleared (a CPU loss, or a GPU one no enabled GradScaler reads for: one host read), and
that is neither sampled, timed nor fed to the detectors, takes the plain path (keep the loss, count
the step) and runs no optimizer hook: on a launch-bound step these microseconds of cold Python are
the monitor's whole cost."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from mixprec.errors import UsageError
from mixprec.monitor.detectors import Detector, UpdateView
from mixprec.monitor.findings import REPLICAS_DIFFER, RESCUE, STOP, UNWATCHED, MonitorFinding
from mixprec.monitor.rescue import SHARED_RESCUES, Rescue
from mixprec.monitor.shadow import grad_norm

# Steps after which a policy (or GradScaler) the loop has never stepped is not the loop's, where the
# monitor holds no optimizer whose post-step hook says the loop stepped one (more micro-batches of
# gradient accumulation than this between two optimizer steps are not a loop anyone runs)
UNCONFIRMED_STEPS = 50
_NEGATIVE_INFINITY = -math.inf  # (a loss of -inf is not finite: the quick test does not clear it)


def unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer): its step hooks fire, its state is the real one."""
    while not hasattr(optimizer, "_optimizer_step_post_hooks") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    return optimizer


def check_loss(loss: Any, call: str) -> None:
    """One line for a loss the monitor cannot keep: it records one number a step (a per-sample
    vector would otherwise fail deep inside, at the sampled step that reads the losses)."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() == 1:
            return
        raise UsageError(
            f"{call}() takes the step's loss as a scalar, got a tensor of shape {list(loss.shape)} (a "
            f"per-sample loss?); reduce it first, as the backward does: {call}(loss.mean(), batch)."
        )
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):  # (numpy's scalars are Real)
        raise UsageError(
            f"{call}() takes the step's loss, a scalar tensor or a number, got {type(loss).__name__}."
        )


# Every this many steps the ranks also compare their replicas (Megatron's
# --check-weight-hash-across-dp-replicas-interval): a float64 sum of each rank's parameters, equal
# bit for bit between DDP replicas (the same all-reduced gradients, the same optimizer), and whether
# each rank's weights and optimizer state are finite (a checkpoint any rank would refuse is refused).
REPLICA_CHECK_EVERY = 100


def agreement_group(group: Any = None) -> Any | None:
    """The process group whose ranks must take every decision together: ``group`` (a DDP module's
    own, where tensor or pipeline parallelism splits the world), else torch.distributed's default
    one, initialised and with more than one rank; None for a single process."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


class UpdateGate:
    """The before/after-update state of one :class:`~mixprec.monitor.Monitor` (``run``, which keeps
    the record: the step, the findings, the withheld steps) and its plain path."""

    def __init__(self, run: Any, scaler: torch.amp.GradScaler | None) -> None:
        self.run = run  # (the Monitor, typed loosely: its module imports this one)
        self.policy, self.scale = run.policy, run.scale  # (the plain path reads them each step)
        self.updating = [d for d in run.detectors if type(d).on_update is not Detector.on_update]
        self.grad_each = run.config.spike_grad_norm
        # what before_step handed over and its quick test did not clear: (step, loss, batch, batch
        # index, gradient norm, the loss's value where read)
        self.staged: tuple[int, Any, Any, int | None, float | None, float | None] | None = None
        self.read: tuple[Any, float] | None = None  # (the loss tensor, its value) read before the update
        self.withheld_at = -1  # the last step whose update the monitor withheld
        self.held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # optimizer: its gradients
        self.on_host: bool | None = None  # whether a staged loss tensor is read before the update
        # and whether before_step reads it at once: a CPU loss (no sync), or a device loss no
        # GradScaler synchronises for (one read a step, what withholding a spike before its update
        # costs on a GPU: the H200's torchrun run updated on a 1e6 loss it read at the next sample)
        self.read_at_once = False
        self.plain_until = 0  # the steps before it take the plain path (Monitor._next_busy_step)
        # the optimizers' pre-step hooks (before_update) while a staged step waits, their post-step
        # hooks (after_update) while an update must be seen: a CPU run's normal step arms neither
        # (an optimizer hook costs microseconds of cold Python a step)
        self.armed: list[Any] = []
        self.after: list[Any] = []
        # whether the loop steps the policy (or GradScaler) the monitor reads its skips from is not
        # known until it steps: checked at each step until it is (confirm)
        policy = self.policy
        self.unconfirmed = policy is not None or (scaler is not None and scaler.is_enabled())
        self.policy_steps = policy.stats.steps if policy is not None else 0
        self.updates = 0  # optimizer steps (the post-step hook), while that is unconfirmed
        # Data parallel: the ranks hold the same all-reduced gradients, so an update one rank
        # withholds and another applies leaves them with different weights for good. Every rank
        # reaches the pre-step hook each step and agrees there (one all-reduce of a flag per rank):
        # withheld or stopped on any rank is withheld or stopped on all.
        self.group = agreement_group(getattr(run, "dp_group", None))
        self.rank = torch.distributed.get_rank(self.group) if self.group is not None else 0  # (in the group)
        self.agreed = False  # this step's agreement is made (reset by Monitor._record each step)
        self.rounds = 0  # agreements made: the replica checks' clock (optimizer steps, not observes)
        self.stop_agreed = False
        self.replicas = bool(getattr(run, "replicated", False))  # DDP: every rank holds the whole model
        self.remote_poisoned: str | None = None  # another rank's state held inf/NaN at the last check
        # a rescue that changes how the run computes (an fp32 island, fp16 -> bf16, ...), proposed by
        # this rank's detectors since the last agreement: taken by every rank at the next one
        self.proposed: tuple[MonitorFinding, Rescue] | None = None
        if self.group is not None:
            self.armed = [o.register_step_pre_hook(self.before_update) for o in run.optimizers]
        self.requiet()

    def requiet(self) -> None:
        """The quick test anew: a staged loss at or below :attr:`quiet` needs no detector (each keeps
        its ``quiet_below`` current as its range grows)."""
        self.quiet = min((d.quiet_below for d in self.updating), default=math.inf)

    # ------------------------------------------------------------------ before the update
    def before_step(self, loss: Any, batch: Any, index: int | None, norm: float | None) -> None:
        """:meth:`Monitor.before_step <mixprec.monitor.Monitor.before_step>`: the loss read and cleared
        by the quick test now (:attr:`read_at_once`), else staged for the optimizers' pre-step hook."""
        value = None
        if self.read_at_once and norm is None and not self.grad_each:
            # the quick test now, on a value the host holds (it stays cold code: keep it short; a
            # loss item() refuses is checked below, where the error names the fix)
            try:
                value = loss.item()
            except (RuntimeError, AttributeError):
                value = None
            else:
                self.read = (loss, value)
                if _NEGATIVE_INFINITY < value <= self.quiet:
                    if batch is not None:
                        self.run.control_batch = batch
                    return  # a normal step: its value joins the detectors' ranges with the next batch
        run = self.run
        if run._closed:
            return
        check_loss(loss, "before_step")
        if self.on_host is None:  # (the first step: whether its loss can be read without a sync)
            scaler = self.scale.scaler or (self.policy.scaler if self.policy is not None else None)
            tensor = isinstance(loss, torch.Tensor)
            scaling = scaler is not None and scaler.is_enabled()  # (nanoGPT's GradScaler(enabled=False))
            self.read_at_once = tensor and (loss.device.type == "cpu" or not scaling)
            # (a device loss with a GradScaler: in the pre-step hook, after the scaler's own read)
            self.on_host = self.read_at_once or (tensor and scaling)
            if self.read_at_once:  # (read now, as every later step is)
                self.before_step(loss, batch, index, norm)
                return
        self.staged = (run.step, loss, batch, index, norm, value)
        if not self.armed:
            self.armed = [o.register_step_pre_hook(self.before_update) for o in run.optimizers]

    def check_update(self, optimizer: Any) -> bool:
        """:meth:`Monitor.check_update <mixprec.monitor.Monitor.check_update>`."""
        optimizer = unwrapped(optimizer)
        if self.staged is not None and self.scaler_skips(optimizer):
            self.staged = None
        # an adapter's call comes after the backward, which a framework may run inside
        # optimizer.step (Lightning's closure: after the pre-step hook agreed): agreed again here,
        # as every rank runs the same adapter
        self.agreed = False
        self.before_update(optimizer)
        return self.withheld_at == self.run.step

    def before_update(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """The optimizers' pre-step hook: what the quick test did not clear goes to the detectors,
        and a withheld update is held. A GradScaler that found inf/NaN does not step a for-loop or
        foreach optimizer, but it does step a fused one (the kernel takes the inf flag and skips
        itself): such a step is the skip path's, as :meth:`check_update` has it. Over data-parallel
        ranks the decision is then agreed (:meth:`agree`)."""
        self._decide(optimizer)
        if self.group is not None and not self.agreed:
            self.agree(optimizer)

    def _decide(self, optimizer: torch.optim.Optimizer) -> None:
        """This rank's decision on the update (:meth:`before_update`)."""
        run, staged = self.run, self.staged
        if staged is None:  # a normal step, or decided for an optimizer before this one
            if self.withheld_at == run.step and id(optimizer) not in self.held:
                self._hold(optimizer)
            return
        self.staged = None
        step, loss, batch, index, norm, value = staged
        if run.stopped or step != run.step:
            return
        if value is None and isinstance(loss, torch.Tensor) and self.on_host:
            value = loss.item()  # (a device loss: its GradScaler has just synchronised)
        elif not isinstance(loss, torch.Tensor):
            value = float(loss)
        if value is not None:
            self.read = (loss, value)
        if norm is None and self.grad_each:
            norm = grad_norm([p for o in run.optimizers for g in o.param_groups for p in g["params"]])
        if (value is None or value <= self.quiet) and norm is None:
            if value is not None and math.isfinite(value) and batch is not None:
                run.control_batch = batch
            return
        if self.scaler_skips(optimizer):  # (read after the loss: the host has synchronised)
            return
        batch = batch if run.loss_fn is not None else None
        if self._ask(UpdateView(step, value, norm, batch, index)):
            self.withheld_at = step
            self._hold(optimizer)

    def _ask(self, view: UpdateView) -> bool:
        """The step to the ``on_update`` detectors until one explains it; whether its update is
        withheld (an action withheld it, or the run was stopped)."""
        run = self.run
        run.rescuer.withholding = False
        for detector in self.updating:
            if detector.on_update(run, view):
                run._explained.add(view.step)
                break
            if run.stopped:
                break
        withheld = run.rescuer.withholding or bool(run.stopped)
        if withheld:
            run.withheld.append(view.step)
        self.requiet()
        return withheld

    def agree(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank's decision on this step's update, in one all-reduce of a code per rank (0: it
        lands, 1: withheld, 2: the run stopped): withheld or stopped on any rank is withheld or
        stopped on this one too, with a finding naming the ranks whose evidence decided it (their own
        findings say what they saw). A stop is raised by :meth:`Monitor.observe` only once agreed,
        so every rank leaves the loop at the same step."""
        run = self.run
        dist, group = torch.distributed, self.group
        step, rank, world = run.step, self.rank, dist.get_world_size(group)
        self.agreed = True
        own = 2 if run.stopped else 1 if self.withheld_at == step else 0
        params = list(run.model.parameters())
        on_nccl = dist.get_backend(group) == "nccl"
        device = params[0].device if on_nccl and params else "cpu"
        # per rank: its decision, on a replica check its parameters' sum and whether its state is
        # finite, and the rescue it proposes (its code, its module's index + 1)
        rows = torch.zeros(world, 5, dtype=torch.float64, device=device)
        rows[rank, 0] = own
        proposed, self.proposed = self.proposed, None
        if proposed is not None:
            rescue, modules = proposed[1], self.module_names()
            rows[rank, 3] = SHARED_RESCUES.index(rescue.name) + 1
            rows[rank, 4] = modules.index(rescue.module) + 1 if rescue.module in modules else 0
        checking = self.rounds % REPLICA_CHECK_EVERY == 0
        self.rounds += 1
        if checking:
            if self.replicas:
                rows[rank, 1] = sum(p.detach().sum(dtype=torch.float64) for p in params)
            rows[rank, 2] = run.rescuer.nonfinite() is not None
        dist.all_reduce(rows, group=group)
        table = rows.tolist()
        if checking:
            self.check_replicas(step, rank, table)
        if any(row[3] for row in table):
            self.take_rescues(step, rank, table, proposed)
        others = {r: int(row[0]) for r, row in enumerate(table) if row[0] and r != rank}
        self.stop_agreed = self.stop_agreed or own == 2 or 2 in others.values()
        if not others:
            return
        names = ", ".join(str(r) for r in sorted(others))
        evidence = {"rank": rank, "decided_by_ranks": sorted(others)}
        if 2 in others.values() and not run.stopped:
            run.stopped = (
                f"step {step}: rank {names} stopped the run (its findings say why); every rank stops at "
                "this step, so none waits for the others in a collective"
            )
            run._emit(MonitorFinding(step, STOP, run.stopped, None, evidence))
        if self.withheld_at != step:
            self.withheld_at = step
            run.withheld.append(step)
            self._hold(optimizer)
            said = (
                f"update withheld on every rank: rank {names} withheld it (its findings say why); the "
                "ranks hold the same all-reduced gradients, so all must skip it to keep the same weights"
            )
            run._emit(MonitorFinding(step, RESCUE, said, None, evidence, action="update withheld"))

    def take_rescues(
        self,
        step: int,
        rank: int,
        table: list[list[float]],
        proposed: tuple[MonitorFinding, Rescue] | None,
    ) -> None:
        """Every rescue any rank proposed, taken on this one, in rank order (one proposed twice,
        once), so the ranks go on computing alike; another rank's is said with the ranks it came from."""
        run, modules = self.run, self.module_names()
        taken: dict[tuple[str, str | None], list[int]] = {}
        for r, row in enumerate(table):
            if row[3]:
                name = SHARED_RESCUES[int(row[3]) - 1]
                module = modules[int(row[4]) - 1] if row[4] else None
                taken.setdefault((name, module), []).append(r)
        for (name, module), ranks in taken.items():
            if proposed is not None and rank in ranks:
                run.take(proposed[0], proposed[1], rank=rank, decided_by_ranks=ranks)
                continue
            said = f"rank {', '.join(map(str, ranks))} proposed it (its findings say why)"
            finding = MonitorFinding(step, RESCUE, said, module, {"rank": rank, "decided_by_ranks": ranks})
            run.take(finding, run.rescuer.action(name, module), rank=rank, decided_by_ranks=ranks)

    def module_names(self) -> list[str]:
        """The model's module names in order: the same list on every replica (an index names one)."""
        return [name for name, _ in self.run.model.named_modules()]

    def check_replicas(self, step: int, rank: int, table: list[list[float]]) -> None:
        """What a replica check found (:data:`REPLICA_CHECK_EVERY`): another rank's state not finite
        (this rank's checkpoints are refused until a check finds every rank finite again), replicas
        whose parameters differ (a ``replicas_differ`` finding: they were to be equal)."""
        poisoned = [r for r, row in enumerate(table) if row[2] and r != rank]
        self.remote_poisoned = (
            f"rank {', '.join(map(str, poisoned))}'s weights or optimizer state held inf/NaN at step {step}"
            if poisoned
            else None
        )
        sums = [row[1] for row in table]
        if self.replicas and not poisoned and all(map(math.isfinite, sums)) and len(set(sums)) > 1:
            said = (
                f"the data-parallel replicas' weights differ at step {step} (float64 sums per rank: "
                f"{', '.join(f'{v:.17g}' for v in sums)}): they were to stay equal (the same all-reduced "
                "gradients, the same optimizer); a rank-local update or a corrupted copy. A checkpoint "
                "from one rank is not the run's"
            )
            self.run._emit(MonitorFinding(step, REPLICAS_DIFFER, said, None, {"sums": sums}))

    def scaler_skips(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the run's GradScaler has found inf/NaN in ``optimizer``'s gradients (it will skip
        the step itself: the skip path explains it, the weights do not move)."""
        scaler = self.scale.scaler or (self.policy.scaler if self.policy is not None else None)
        if scaler is None or not scaler.is_enabled():
            return False
        found = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device") or {}
        return bool(found) and bool(sum(float(v) for v in found.values()))

    def _hold(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand ``optimizer`` no gradient for this step (they are back after it)."""
        held = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for p, _ in held:
            p.grad = None
        self.held[id(optimizer)] = held
        self.hook_updates()  # (the gradients go back after the update)

    def disarm(self) -> None:
        for handle in self.armed:
            handle.remove()
        self.armed = []

    # ------------------------------------------------------------------ after the update
    def after_update(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """The optimizers' post-step hook: a withheld update's gradients back, else the stalls of a
        sampled step counted (and the update, while the loop is unconfirmed)."""
        self.updates += self.unconfirmed
        held = self.held.pop(id(optimizer), None) if self.held else None
        if held is None:
            self.run.sampler.count_stalls(self.run.step)
            return
        for p, g in held:  # the gradients back, as the loop left them
            p.grad = g
        self.run.sampler.discard_stalls()  # a withheld update moved nothing: no stall to count

    def hook_updates(self) -> None:
        """Arm the optimizers' post-step hooks (:meth:`after_update`) while an update must be
        seen: the loop's optimizer steps are counted until it is confirmed, and a sampled step's
        stalls are counted at its update (an accumulating loop's comes micro-batches later); else
        remove them. A withheld update arms them itself (:meth:`_hold`)."""
        if self.unconfirmed or self.run.sampler.awaits_update or self.held:
            if not self.after:
                self.after = [o.register_step_post_hook(self.after_update) for o in self.run.optimizers]
        elif self.after:
            for handle in self.after:
                handle.remove()
            self.after = []

    def plain(self, loss: Any, step: int) -> float | None:
        """The loss of a plain step (the common one), else None: its loss was read and cleared
        before the update, it is neither sampled, timed nor fed to the detectors, no hook waits and
        the policy skipped nothing. The rest of the Monitor's ``_record`` costs microseconds of cold
        Python on every step; this is the whole of what such a step (``step``) needs."""
        read = self.read
        if (
            step < self.plain_until
            and read is not None
            and read[0] is loss
            and not self.armed
            and not self.run._pending  # (a loss kept on the device goes first: the whole path keeps order)
            and self.policy.stats.skipped_steps == self.scale.skips_seen
        ):
            self.read = None
            return read[1]
        return None

    def settle(self, step: int) -> tuple[Any, float] | None:
        """``step``'s update is behind it (the whole path): the loop confirmed (:meth:`confirm`) and
        what :meth:`before_step` handed over cleared; returns the loss read before the update
        (tensor, value), or None."""
        if self.unconfirmed:
            self.confirm(step)
        read, self.staged, self.read = self.read, None, None
        if self.armed and self.read_at_once and self.group is None:
            self.disarm()  # (a loss read by before_step's quick test needs no hook; ranks agree in it)
        return read

    def confirm(self, step: int) -> None:
        """Whether the loop steps the policy (or plain GradScaler) the monitor reads its skips and
        loss scale from. A loop that steps its own GradScaler instead skips steps the monitor never
        hears of. Once the optimizer has stepped (its post-step hook) while the policy's ``step()``
        never ran (a GradScaler never scaled a loss), or, where the monitor holds no optimizer, once
        :data:`UNCONFIRMED_STEPS` steps passed so, that is an ``unwatched`` finding (once)."""
        policy = self.policy
        if policy is not None:
            used = policy.stats.steps != self.policy_steps
            what = f"the monitor's Policy ({policy.name}) never did"
            fix = (
                "step through the policy (policy.backward(loss); policy.step(optimizer)), or give the "
                "monitor what the loop steps (Monitor(model, scaler=the_loops_scaler) for a plain "
                "torch.amp loop)"
            )
        else:
            used = getattr(self.scale.scaler, "_scale", None) is not None  # made at its first scale()
            what = "the monitor's GradScaler never scaled a loss"
            fix = "pass the GradScaler the loop steps (Monitor(model, scaler=scaler))"
        if used:
            self.unconfirmed = False
            return
        if not self.updates and step + 1 < UNCONFIRMED_STEPS:
            return  # nothing has stepped yet (skips, accumulation): not clear yet
        self.unconfirmed = False
        n = self.updates
        seen = f"the optimizer stepped {n} time{'s' if n > 1 else ''}" if n else f"{step + 1} steps ran"
        message = (
            f"{seen} but {what}: the loop steps its own, so the monitor sees none of its skipped steps "
            f"or its loss scale and vouches for nothing; {fix}"
        )
        evidence = {"optimizer_steps": n, "steps": step + 1}
        self.run._emit(MonitorFinding(step, UNWATCHED, message, None, evidence))

    def close(self) -> None:
        """The hooks removed; :meth:`before_step`'s quick test reads nothing more."""
        self.read_at_once = False
        self.disarm()
        for handle in self.after:
            handle.remove()
        self.after = []
