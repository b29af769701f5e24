"""What the monitor can do about a finding, each action one method that says what it did ('' when
it could not): an fp32 island made live, fp16 switched to bf16, a roll-back to an in-memory
snapshot, a planned precision switch; and, on one step's update only, withholding it (its batch on
the skip list) or retrying it with a replay's gradients. Every action keeps the weights and the
optimizer state."""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError, UsageError
from mixprec.policy import Policy
from mixprec.policy.hooks import keep_in_fp32
from mixprec.policy.policy import widen_to_fp32
from mixprec.policy.registry import mixed_twin

log = logging.getLogger("mixprec.monitor")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's own shard: what this rank can check without a collective."""
    return t.to_local() if hasattr(t, "to_local") else t


def _wide_sum(t: torch.Tensor) -> torch.Tensor:
    """A sum that does not overflow a half tensor's own format (fp16 sums pass 65504 easily)."""
    return t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)


def _saved_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The floating buffers a checkpoint of ``model`` holds (its persistent ones: a BatchNorm's
    running statistics; a non-persistent one is not in its ``state_dict``)."""
    found = []
    for prefix, module in model.named_modules():
        skipped = module._non_persistent_buffers_set
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.numel() and name not in skipped:
                found.append((f"{prefix}.{name}" if prefix else name, _local(b.detach())))
    return found


def _first_nonfinite(tensors: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first of ``tensors`` holding inf/NaN, or None.

    One sum per tensor screens them all (an inf or NaN makes the sum non-finite), read once per
    device; only a tensor whose sum is not finite is searched element by element, since a large
    finite tensor can sum past the float32 range too. About a tenth of an element-wise check of
    every tensor (ResNet-50's weights and SGD momentum on a CPU: 4 ms instead of 52)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    suspects: list[int] = []
    with torch.no_grad():
        for indices in by_device.values():
            sums = torch.stack([_wide_sum(tensors[i][1]) for i in indices])
            finite = torch.isfinite(sums).tolist()
            suspects += [i for i, ok in zip(indices, finite, strict=True) if not ok]
        for i in sorted(suspects):
            name, t = tensors[i]
            if not bool(torch.isfinite(t).all()):
                return name
    return None


def nonfinite_buffers(model: nn.Module) -> frozenset[str]:
    """The saved floating buffers of ``model`` that hold inf/NaN now: made at the start of a run,
    they are by design (an attention mask of -inf), not state gone bad."""
    bad, buffers = set(), _saved_buffers(model)
    while (name := _first_nonfinite(buffers)) is not None:
        bad.add(name)
        buffers = [(n, b) for n, b in buffers if n != name]
    return frozenset(bad)


def nonfinite_state(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    buffers: bool = False,
    by_design: Collection[str] = (),
) -> str | None:
    """The first parameter (or its optimizer state) holding inf/NaN, or None. ``buffers``: the
    saved floating buffers too (what a checkpoint holds: an inf BatchNorm ``running_var`` makes
    every eval-mode output of a resumed model garbage), named ``'<name> (buffer)'``, except
    ``by_design`` (:func:`nonfinite_buffers` at the start of the run)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: list[tuple[str, torch.Tensor]] = [
        (name, _local(p.detach())) for name, p in model.named_parameters() if p.is_floating_point()
    ]
    for o in optimizers:
        for param, state in o.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                    tensors.append((f"{names.get(id(param), '?')} (optimizer {key})", _local(value)))
    if buffers:
        tensors += [(f"{n} (buffer)", b) for n, b in _saved_buffers(model) if n not in by_design]
    return _first_nonfinite(tensors)


def module_of(param_name: str) -> str:
    """The module that holds a parameter ('2' for '2.weight', '' for a top-level one)."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def plan_schedule(schedule: Mapping[float, str], train_steps: int, policy: Policy | None) -> dict[int, str]:
    """``{step or fraction of train_steps: policy}`` (its names checked by the config) as ``{step:
    policy}``; the run's policy is checked here, when the monitor is made, not at the step a switch
    is due: a switch needs a Policy with fp32 weights to switch from."""
    planned = {}
    for at, name in schedule.items():
        planned[int(at * train_steps) if isinstance(at, float) and at <= 1.0 else int(at)] = name
    if planned and policy is None:
        raise UsageError(
            "a precision schedule needs the loop's mixprec Policy (Monitor(model, policy, ...))."
        )
    if planned and policy is not None and policy.spec.param_dtype is not None:
        twin = mixed_twin(policy.name)
        raise UsageError(
            f"schedule {dict(schedule)!r} on a {policy.name!r} run: a schedule switches between "
            "policies with fp32 weights, and a *-true run keeps its weights in half precision; train "
            f"under {twin!r} (the same compute with fp32 master weights) to schedule a switch, or drop "
            "the schedule (with rescue=True a stall still gets fp32 master weights live)."
        )
    return planned


# The rescues that change how the run computes or what it holds, by name: over data-parallel ranks
# each is agreed and taken on every rank (:meth:`mixprec.monitor.gate.UpdateGate.agree`), so the
# ranks keep computing alike. Their index + 1 is the code a rank puts in the agreement's tensor.
SHARED_RESCUES = ("island", "to_bf16", "master_weights", "roll_back")


@dataclass(frozen=True)
class Rescue:
    """One of :data:`SHARED_RESCUES` on a rescuer, named so another rank can take the same one
    (``module``: the island's); calling it takes it here."""

    rescuer: Any
    name: str
    module: str | None = None

    def __call__(self) -> str:
        act = getattr(self.rescuer, self.name)
        return act(self.module) if self.name == "island" else act()


class Rescuer:
    """The actions, on one run's model, policy and optimizers."""

    def action(self, name: str, module: str | None = None) -> Rescue:
        """The named rescue (:data:`SHARED_RESCUES`), to hand to ``Run.report``."""
        assert name in SHARED_RESCUES, name
        return Rescue(self, name, module)

    def __init__(
        self,
        model: nn.Module,
        policy: Policy | None,
        optimizers: Sequence[torch.optim.Optimizer],
        skip_list: str | os.PathLike[str] | None = None,
    ):
        self.model, self.policy, self.optimizers = model, policy, list(optimizers)
        self.snapshot: dict[str, Any] | None = None
        self.skip_list = Path(skip_list) if skip_list is not None else None
        self.skipped_batches: list[int] = []  # what the skip list holds, in the order they were skipped
        self.withholding = False  # this step's update is withheld (the Monitor clears the gradients)
        # a framework adapter's own step after the weights were widened without a Policy (Lightning
        # swaps its bf16-true precision plugin for bf16-mixed; Monitor.when_widened sets it)
        self.after_widening: Callable[[], str] | None = None
        # buffers that hold inf/NaN before the run (an attention mask of -inf) are by design: the
        # checks of the state a checkpoint or snapshot keeps leave them out
        self.by_design = nonfinite_buffers(model)

    def nonfinite(self) -> str | None:
        """The first weight, optimizer state or saved buffer holding inf/NaN (what a checkpoint or
        snapshot keeps), or None."""
        return nonfinite_state(self.model, self.optimizers, buffers=True, by_design=self.by_design)

    def island(self, module: str | None) -> str:
        """Make ``module`` an fp32 island (*-mixed policies, or a plain autocast loop over fp32
        weights); one already: fp16 goes to bf16."""
        if not module:
            return ""
        if self.policy is None:
            return self._plain_island(module)
        if self.policy.spec.param_dtype is not None:
            return ""
        try:
            added = self.policy.keep_fp32_now(self.model, [module])
        except MixprecError as exc:
            log.debug("fp32 island refused: %s", exc)
            return ""
        if not added:
            return self.to_bf16()
        keep = list(self.policy.config.keep_fp32)
        return f"{module!r} now computes in fp32 (policy {self.policy.config.label}, keep_fp32={keep})"

    def _plain_island(self, module: str) -> str:
        """A plain loop's autocast: the module runs outside it, on fp32 inputs."""
        target = dict(self.model.named_modules()).get(module)
        if target is None or getattr(target, "_fp32_island", False):
            return ""
        if any(p.dtype != torch.float32 for p in target.parameters() if p.is_floating_point()):
            return ""
        device = next((p.device.type for p in self.model.parameters()), "cpu")
        keep_in_fp32(target, device)
        return f"{module!r} now computes in fp32 (outside autocast)"

    def to_bf16(self) -> str:
        """fp16-mixed -> bf16-mixed where the device computes bf16."""
        if self.policy is None or self.policy.name != "fp16-mixed":
            return ""
        if self.policy.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return ""
        self.policy.switch("bf16-mixed")
        return (
            "switched to bf16-mixed (fp32's range; the weights and optimizer state carried over, "
            "the scaler retired)"
        )

    def master_weights(self) -> str:
        """Half-precision weights whose updates round away -> fp32 master weights, live: a *-true
        policy switches to its *-mixed twin (:meth:`Policy.switch` widens weights and optimizer
        state exactly); a loop without a Policy has its half weights, buffers and optimizer state
        widened in place, and trains in fp32 from there (under the framework's autocast where it
        has one)."""
        if self.policy is not None:
            target = mixed_twin(self.policy.name)
            if target is None:
                return ""
            before = self.policy.config.label
            self.policy.switch(target, self.model, self.optimizers)
            return (
                f"switched from {before} to {target}: the half weights and optimizer state widened "
                "to fp32 master weights (exactly), so updates below half a ulp count again"
            )
        half = {p.dtype for p in self.model.parameters() if p.dtype in (torch.bfloat16, torch.float16)}
        if not half:
            return ""
        for dtype in half:
            widen_to_fp32(self.model, self.optimizers, dtype)
        done = "the half weights, buffers and optimizer state widened to fp32 (exactly)"
        after = self.after_widening() if self.after_widening is not None else ""
        return f"{done}; {after}" if after else f"{done}; the loop computes in fp32 from here"

    # ------------------------------------------------------------------ this step's update only
    def withhold(self, skip: int | None = None) -> str:
        """Withhold this step's update, as an overflow skip does: the optimizer steps no parameter
        (the Monitor hands it no gradient; they are back after its step), its state untouched.
        ``skip``: the batch's index, added to the skip list."""
        self.withholding = True
        done = "the update was withheld (weights and optimizer state as before the step)"
        if skip is None:
            return done
        self.skipped_batches.append(int(skip))
        if self.skip_list is None:
            return f"{done}; batch {skip} is to skip"
        self.skip_list.parent.mkdir(parents=True, exist_ok=True)
        self.skip_list.write_text(json.dumps(self.skipped_batches, indent=4) + "\n", encoding="utf-8")
        return f"{done}; batch {skip} added to {self.skip_list}"

    def retry(self, grads: Sequence[torch.Tensor | None] | None) -> str:
        """Retry this step once: its update is computed from the replay's gradients (the same batch
        through the same weights, where the fault did not recur) instead of the spiked ones."""
        if grads is None:
            return ""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if len(params) != len(grads):
            return ""
        for p, g in zip(params, grads, strict=True):
            if p.grad is not None and g is not None:
                with torch.no_grad():
                    p.grad.copy_(g)
            else:
                p.grad = g
        return "retried: the update is the replay's, whose gradients did not spike"

    def take_snapshot(self, step: int) -> None:
        """Keep the run's state in memory to roll back to (never a non-finite one)."""
        if self.nonfinite() is not None:
            return
        self.snapshot = {
            "step": step,
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
            "policy": copy.deepcopy(self.policy.state_dict()) if self.policy is not None else None,
            "rng": torch.get_rng_state(),
        }

    def roll_back(self) -> str:
        """Load the last snapshot's model, optimizer and policy state and RNG (a switch since stays)."""
        snap = self.snapshot
        if snap is None:
            return ""
        self.model.load_state_dict(snap["model"])
        for o, state in zip(self.optimizers, snap["optimizers"], strict=True):
            o.load_state_dict(state)
        if self.policy is not None and snap["policy"] is not None:
            with_name = dict(snap["policy"], policy=self.policy.config.to_dict())  # a switch since is kept
            self.policy.load_state_dict(with_name)
        torch.set_rng_state(snap["rng"])
        return f"rolled back to the snapshot of step {snap['step']} (the batches since are skipped)"

    def switch(self, name: str) -> str:
        """A planned switch to policy ``name``."""
        assert self.policy is not None
        before = self.policy.config.label
        self.policy.switch(name)
        return f"switched from {before} to {name} as scheduled"
