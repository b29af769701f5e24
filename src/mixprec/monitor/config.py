"""What the monitor watches and may do: one frozen :class:`MonitorConfig`, checked once on creation.

``Monitor(model, policy, config=..., **fields)`` takes it whole or field by field (``fields``
replace the config's); the adapters (Lightning, the HF Trainer, Accelerate) and ``mixprec train``
pass it on. ``to_dict`` is what a run records of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixprec import validation
from mixprec.errors import PolicyError, UsageError, did_you_mean
from mixprec.policy.registry import ALIASES, POLICIES, canonical_name, mixed_twin

HOLD = 50
MAX_RESCUES = 3
TRAIN_STEPS = 10_000


def switch_targets() -> list[str]:
    """The policies a run may switch to mid-run: those with fp32 weights (``Policy.switch``)."""
    return [n for n, s in POLICIES.items() if s.param_dtype is None and s.low_format is None]


def schedule_target(at: float, name: Any) -> str:
    """The canonical name of the policy ``schedule[at]`` switches to, checked when the config is
    made (not at the step it is due, halfway through the run): a known policy (or alias) with fp32
    weights, since narrowing weights and optimizer state to half precision mid-run is not exact."""
    valid = switch_targets()
    entry = f"schedule {{{at!r}: {name!r}}}"
    if not isinstance(name, str):
        raise UsageError(
            f"schedule values are policy names, got {name!r} ({entry}); valid: {', '.join(valid)}."
        )
    try:
        canonical = canonical_name(name)
    except PolicyError:
        raise UsageError(
            f"{entry}: unknown policy {name!r}; valid: {', '.join(valid)}."
            f"{did_you_mean(name.strip().lower(), [*valid, *ALIASES])}"
        ) from None
    if canonical in valid:
        return canonical
    twin = mixed_twin(canonical)
    why = (
        "would narrow the weights and optimizer state to half precision mid-run (not exact)"
        if twin
        else "needs its layers converted when the model is prepared, not mid-run"
    )
    fix = f"{twin!r} (the same compute with fp32 master weights)" if twin else "'bf16-mixed' or 'fp32'"
    raise UsageError(
        f"{entry}: a switch to {canonical!r} {why}; a schedule switches to a policy with fp32 "
        f"weights: {', '.join(valid)}. Use {fix}."
    )


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """One monitored run's settings. Every field is checked when the config is made."""

    every: int | None = None
    """Steps between sampled steps (per-layer ranges, the losses since the last one, trends, the
    finite check of the weights). None: 100, or less often where sampled steps would cost more than
    0.15% of the run's time (:mod:`mixprec.monitor.sampler`), but at least 8 samples over
    ``train_steps`` (the trend rules need points: a 300-step run is sampled every 37 steps); a
    number is kept as it is."""

    shadow_every: int = 0
    """Steps between fp32 shadow steps (forward and backward in the policy and in fp32 on the same
    batch, for the ``drift`` finding); 0: only the forward shadow of a skipped step."""

    rescue: bool = False
    """Act on what blames the precision (fp32 islands, bf16 for a collapsing fp16 run, fp32 master
    weights, a roll-back). False: alert only, the run is never touched."""

    train_steps: int = TRAIN_STEPS
    """The run's length in steps: a layer predicted to overflow within it is a finding now, and a
    schedule's fractions are of it."""

    snapshot_every: int = 0
    """Steps between in-memory snapshots of the model, optimizers and policy that poisoned weights
    roll back to (0: none, and nothing to roll back to)."""

    schedule: Mapping[float, str] | None = None
    """Planned precision switches, ``{step, or fraction of train_steps: policy name}`` (e.g.
    ``{0.9: "fp32"}`` to finish the run in fp32), to a policy with fp32 weights (*-mixed, fp32,
    tf32, bf32; aliases are kept as their canonical names); needs the loop's mixprec Policy, one
    with fp32 weights too (a *-true run has no fp32 master weights to switch from)."""

    hold: int = HOLD
    """Steps between two actions, and within which the same finding is not reported again: an
    action's effect shows before the next one."""

    max_rescues: int = MAX_RESCUES
    """Actions before the monitor stops the run rather than train on garbage (a plain loop:
    :class:`~mixprec.monitor.MonitorStop`; Lightning and the HF Trainer stop through their own
    flag)."""

    spikes: bool = True
    """Find loss (and gradient-norm) spikes as they happen, against the run's own range (the
    median/MAD of its log over a warm-up, then running averages), and diagnose each before its
    update lands: its batch replayed from the same weights in fp32 and in the policy says data,
    precision or transient (the loop hands the loss and batch over before the optimizer step:
    :meth:`~mixprec.monitor.Monitor.before_step`; the adapters and ``mixprec train`` do). With
    ``rescue=True`` a data spike's update is withheld and its batch added to the skip list, a
    precision spike's module becomes an fp32 island (its update withheld), a transient one is retried."""

    spike_grad_norm: bool = False
    """Also compute the gradient norm every step for the spike test: one pass over the gradients a
    step (a few % of a CPU ResNet-50 step; the default budget cannot pay it). Off, the norm is
    tested where the loop hands it over for free (``before_step(grad_norm=...)``, e.g. the norm
    ``clip_grad_norm_`` returned)."""

    def __post_init__(self) -> None:
        validation.optional_positive_int("every", self.every)
        validation.positive_int("shadow_every", self.shadow_every, zero_ok=True)
        validation.boolean("rescue", self.rescue)
        validation.positive_int("train_steps", self.train_steps)
        validation.positive_int("snapshot_every", self.snapshot_every, zero_ok=True)
        validation.positive_int("hold", self.hold, zero_ok=True)
        validation.positive_int("max_rescues", self.max_rescues, zero_ok=True)
        validation.boolean("spikes", self.spikes)
        validation.boolean("spike_grad_norm", self.spike_grad_norm)
        if self.schedule is not None:
            what = "steps (or fractions of train_steps) mapped to policy names"
            validation.require("schedule", self.schedule, isinstance(self.schedule, Mapping), what)
            planned = {}
            for at, name in self.schedule.items():
                ok = isinstance(at, int | float) and not isinstance(at, bool) and at >= 0
                validation.require("schedule keys", at, ok, "steps or fractions of train_steps (>= 0)")
                planned[at] = schedule_target(at, name)
            object.__setattr__(self, "schedule", planned)

    def replace(self, **changes: Any) -> MonitorConfig:
        """This config with ``changes``: :func:`mixprec.validation.with_fields`."""
        return validation.with_fields(
            self, changes, "Monitor", notes={"events": "the findings sink is findings= now"}
        )

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (the schedule's steps as strings, {} for none)."""
        return validation.to_dict(self, schedule=self.schedule or {})
