"""What a `tune` run searches and how: one frozen :class:`TuneConfig` holding the
:class:`~mixprec.measure.config.BenchConfig` its sweeps measure with and the
:class:`~mixprec.checking.config.CheckConfig` its numerics checks judge with.

`mixprec.tune(workload, config, **fields)` takes it whole or field by field; the keyword API's flat
names for the nested settings (``steps``, ``warmup``, ``batch_size``, ``device`` for the sweeps,
``check_steps``, ``fix``, ``train_steps`` for the checks) are mapped by :meth:`TuneConfig.with_fields`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixprec import validation
from mixprec.checking.config import TRAIN_STEPS, CheckConfig
from mixprec.errors import UsageError
from mixprec.measure.config import BenchConfig, parse_policies, settle_policies

# The keyword API's flat names of the nested configs' fields: {name: (nested config, its field)}.
FLAT = {name: ("bench", name) for name in ("device", "batch_size", "steps", "warmup")}
FLAT |= {"check_steps": ("check", "steps"), "fix": ("check", "fix"), "train_steps": ("check", "train_steps")}


def _default_bench() -> BenchConfig:
    return BenchConfig(steps=4, warmup=1)


def _default_check() -> CheckConfig:
    return CheckConfig(steps=6, fix=True, train_steps=TRAIN_STEPS)


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """One `tune` run's settings. Every field is checked when the config is made."""

    bench: BenchConfig = field(default_factory=_default_bench)
    """How each sweep measures: paired rounds (``steps``) and untimed steps (``warmup``) per
    candidate, the batch size, the device. Its candidates and baseline are tune's to choose."""

    check: CheckConfig = field(default_factory=_default_check)
    """How each candidate is judged: training steps compared with strict fp32 (``steps``), the
    keep_fp32 rescue search (``fix``), the run length the verdicts are about (``train_steps``: also
    the run a compile is amortised over). Its policies are tune's to choose (among ``policies``)."""

    policies: str | tuple[str, ...] = "all"
    """The precisions tune chooses among: 'all', or policy names (a tuple, or one comma-separated
    string; aliases accepted). Strict fp32 is measured whatever is named: it is every row's
    reference (and a script's own precision, what the user runs today)."""

    budget_s: float = 300.0
    """Seconds for the whole search (measuring, checking, compiling, re-measuring)."""

    lint: bool = True
    """Lint the model under the recommended candidate (where the framework has a linter)."""

    noise: float = 0.03
    """The smallest relative speed difference treated as real."""

    settle: float = 0.05
    """The pick is measured again, in up to five more sessions of at most 8 rounds (three sessions in all
    where its rounds allow, the third only where two disagree), until its speedup's 95%
    interval lies within this share of it either side over all its paired rounds (at most
    ``bench.settle_rounds``, and what the budget pays; :mod:`mixprec.tuning.settle`): the figure the next run
    repeats. 0: the pick's figure as its sweep left it."""

    compile_modes: tuple[str, ...] | None = None
    """Compile modes tried on the best eager candidates (() for none; default: the framework's first,
    torch.compile's "default" or Keras' "xla")."""

    optimizers: bool = True
    """Try the pick with its optimizer's other implementations (foreach, fused)."""

    batch: str | None = None
    """"auto" to search the micro-batch with the precision (:mod:`mixprec.tuning.batching`): each
    candidate at the largest micro-batch that fits ``memory_budget``, accumulating to
    ``effective_batch``; None: every candidate at the bench config's batch size."""

    memory_budget: int | str | None = None
    """With ``batch="auto"``: bytes (or '16GiB', held as bytes) a step may take; on CUDA by default
    the free memory less 10%."""

    effective_batch: int | None = None
    """With ``batch="auto"``: samples per optimizer step (default: the batch size, else the workload's)."""

    def __post_init__(self) -> None:
        validation.require("bench", self.bench, isinstance(self.bench, BenchConfig), "a mixprec BenchConfig")
        validation.require("check", self.check, isinstance(self.check, CheckConfig), "a mixprec CheckConfig")
        settle_policies(self)
        validation.seconds("budget", self.budget_s, zero_ok=False)
        validation.boolean("lint", self.lint)
        validation.fraction("noise", self.noise)
        validation.fraction("settle", self.settle)
        validation.boolean("optimizers", self.optimizers)
        if self.compile_modes is not None:
            modes = (
                (self.compile_modes,) if isinstance(self.compile_modes, str) else tuple(self.compile_modes)
            )
            object.__setattr__(self, "compile_modes", modes)
        what = "'auto' (or None: batch_size for every candidate)"
        validation.require("batch", self.batch, self.batch in (None, "auto"), what)
        if self.memory_budget is not None:
            object.__setattr__(
                self, "memory_budget", validation.byte_size("memory_budget", self.memory_budget)
            )
        validation.optional_positive_int("effective_batch", self.effective_batch)
        if self.batch is None and (self.memory_budget is not None or self.effective_batch is not None):
            raise UsageError(
                "memory_budget and effective_batch apply to batch='auto' (--batch auto); pass it too."
            )
        if self.check.device is not None and self.check.device != self.bench.device:
            raise UsageError(
                f"tune measures and checks on one device: bench.device={self.bench.device!r}, "
                f"check.device={self.check.device!r}; set device once (TuneConfig().with_fields(device=...))."
            )

    @property
    def policy_names(self) -> list[str]:
        """The canonical names of ``policies``."""
        return parse_policies(self.policies)

    @property
    def device(self) -> Any:
        return self.bench.device

    @property
    def train_steps(self) -> int:
        return self.check.train_steps

    def with_fields(self, **changes: Any) -> TuneConfig:
        """A copy with ``changes`` applied: TuneConfig's own fields by name, and the nested configs'
        by the keyword API's flat names (``steps``, ``warmup``, ``batch_size``, ``device``;
        ``check_steps``, ``fix``, ``train_steps``): :func:`mixprec.validation.with_fields`."""
        return validation.with_fields(self, changes, "tune", flat=FLAT)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (the nested configs' own ``to_dict``)."""
        return validation.to_dict(self, policies=self.policy_names)
