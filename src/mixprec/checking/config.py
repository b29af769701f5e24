"""What a `check` run judges and how: one frozen :class:`CheckConfig`, checked once on creation.

`mixprec.check(workload, config, **fields)` takes it whole or field by field; `tune` holds one
for its numerics checks (:class:`mixprec.tuning.config.TuneConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mixprec import validation
from mixprec.policy import Candidate, Thresholds
from mixprec.policy.registry import CHECK_DEFAULT

TRAIN_STEPS = 10_000
# where a check's run length comes from, as its predictions name it (a default read as the user's own run)
TRAIN_STEPS_SETTING = "--train-steps"


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """One `check` run's settings. Every field is checked when the config is made."""

    policies: str | tuple[str | Candidate, ...] = CHECK_DEFAULT
    """Policy names (a tuple, or one comma-separated string) or whole Candidates to judge."""

    emulate: tuple[str, ...] = ()
    """Formats to predict on strict fp32 by emulated rounding (tf32, bf16, fp8_e4m3, fp8_e5m2)."""

    steps: int = 8
    """Training steps compared with the strict-fp32 reference."""

    batch_size: int | None = None
    """Samples per step (default: the workload's)."""

    device: Any = None
    """'cpu' or 'cuda[:N]' (default: the framework's: CUDA when available)."""

    fix: bool = False
    """Search a keep_fp32 set (or, for the low formats, a precision map) that makes a failing
    candidate pass, verified by checking again."""

    thresholds: Mapping[str, Thresholds] | None = None
    """Per-policy verdict thresholds replacing the defaults
    (:func:`mixprec.numerics.verdict.default_thresholds`)."""

    train_steps: int = TRAIN_STEPS
    """The length of the run the verdicts are about: a layer's range trend predicted to overflow the
    candidate's format (or its updates to stall) within that many steps makes it ``at-risk``."""

    def __post_init__(self) -> None:
        policies, what = self.policies, "policy names or Candidates (a list or a comma-separated string)"
        validation.require("policies", policies, isinstance(policies, str | Sequence), what)
        if isinstance(policies, str):
            policies = tuple(p.strip() for p in policies.split(",") if p.strip())
        object.__setattr__(self, "policies", tuple(policies))
        emulate = (self.emulate,) if isinstance(self.emulate, str) else tuple(self.emulate)
        object.__setattr__(self, "emulate", emulate)
        validation.positive_int("steps", self.steps)
        validation.optional_positive_int("batch_size", self.batch_size)
        validation.boolean("fix", self.fix)
        validation.positive_int("train_steps", self.train_steps)
        thr, what = self.thresholds, "policy names mapped to Thresholds"
        validation.require("thresholds", thr, isinstance(thr, Mapping | None), what)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (candidates by label, thresholds as dicts)."""
        return validation.to_dict(self)
