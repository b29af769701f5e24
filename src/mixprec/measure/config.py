"""What a `bench` run measures and how: one frozen :class:`BenchConfig`, checked once on creation.

`mixprec.bench(workload, config, **fields)` takes it whole or field by field (``fields`` replace
the config's); `tune` and `bench_batches` hand the sweep a ``dataclasses.replace`` of theirs.
``to_dict`` is what a result records of it (``BenchResult.settings``) and what a resumed stream is
keyed on (:func:`mixprec.measure.sweep.resume_key`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixprec import validation
from mixprec.errors import PolicyError, UsageError
from mixprec.policy import POLICY_NAMES, Candidate, canonical_name

CHOICES = ("off", "on", "both")


def parse_policies(policies: str | Sequence[str] | None) -> list[str]:
    """'all', a comma-separated string or a list of names/aliases -> canonical names, in order."""
    if policies is None or policies == "all" or list(policies) == ["all"]:
        return list(POLICY_NAMES)
    items = policies.split(",") if isinstance(policies, str) else list(policies)
    names: list[str] = []
    for item in items:
        name = canonical_name(item.strip())
        if name not in names:
            names.append(name)
    if not names:
        raise PolicyError(
            f"No policy given; valid: all, or a comma-separated list of {', '.join(POLICY_NAMES)}."
        )
    return names


def settle_policies(config: Any) -> None:
    """A frozen config's ``policies`` field as held: 'all' or a comma-separated string as given, any
    other sequence as a tuple; unknown names fail here, with the closest match (BenchConfig's and
    TuneConfig's field alike)."""
    if not isinstance(config.policies, str) and config.policies is not None:
        object.__setattr__(config, "policies", tuple(config.policies))
    parse_policies(config.policies)


def parse_choice(value: str | bool, option: str) -> list[bool]:
    """'off' / 'on' / 'both' (or a bool) -> the values of an on/off axis to measure."""
    if isinstance(value, bool):
        return [value]
    return {"off": [False], "on": [True], "both": [False, True]}[validation.one_of(option, value, CHOICES)]


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One `bench` run's settings. Every field is checked when the config is made."""

    policies: str | tuple[str, ...] = "all"
    """'all', or policy names (a tuple, or one comma-separated string); aliases are accepted."""

    channels_last: str | bool = "both"
    """'off', 'on' or 'both' layouts, where the framework and the model have them."""

    compile: str | bool = "off"
    """'off', 'on' or 'both': each candidate eager and/or compiled (torch.compile's default mode;
    XLA for Keras)."""

    candidates: tuple[Candidate, ...] | None = None
    """Replaces the policies x channels_last x compile grid (e.g. a keep_fp32 rescue, a compiled
    finalist); strict fp32 is always measured too, as the baseline."""

    baseline: Candidate | None = None
    """What every candidate is paired with: strict fp32, eager, NCHW (default), or the same at its
    own micro-batch (``tune --batch auto``: strict fp32 at the largest micro-batch that fits the
    memory budget, accumulating to the run's samples per step)."""

    batch_size: int | None = None
    """Samples per step (default: the workload's); per rank when ``nproc > 1``."""

    accumulation_steps: int = 1
    """Micro-batches of ``batch_size`` per optimizer step (gradient accumulation, each loss divided by
    it): a step is that many forward/backward passes and one optimizer step, and throughput counts
    every micro-batch's samples."""

    steps: int = 10
    """Timed steps (paired rounds) per candidate, at least."""

    warmup: int = 2
    """Untimed steps per candidate, at least (more until the step time is steady)."""

    min_time_s: float = 0.0
    """Keep timing a candidate until this much timed time has passed (at most 200 steps)."""

    settle: float = 0.0
    """Measure a candidate again, in up to five more sessions of at most 8 rounds, until its speedup's 95%
    interval lies within this share of it either side over all its paired rounds (0.05: 5%, a figure the next
    run repeats within about 10%), at most ``settle_rounds`` rounds; 0: one session of ``steps`` rounds. A
    noisy machine takes more rounds (:mod:`mixprec.measure.settle`)."""

    settle_rounds: int = 40
    """With ``settle`` (and tune's): the most paired rounds a candidate gets, over all sessions."""

    prune_factor: float = 5.0
    """Stop a candidate that many times slower than the best so far (compared like with like,
    retried once at the end; see :mod:`mixprec.measure.paired`)."""

    device: Any = None
    """'cpu' or 'cuda[:N]' (default: the framework's: CUDA when available)."""

    isolate: bool | None = None
    """Each candidate in its own process (default: when the workload has a spec): isolated CPU peak
    memory, crash isolation, hard pruning."""

    nproc: int = 1
    """Train every candidate data-parallel on that many ranks (torch DDP; needs a spec); these runs
    are sequential, not paired."""

    threads: int | str = "auto"
    """Intra-op threads on a CPU: 'auto' times the strict-fp32 step at 1..N threads first and
    measures every candidate at the fastest count (on a busy machine fewer threads can be many
    times faster; :mod:`mixprec.measure.threads`), unless OMP_NUM_THREADS is set; or a count."""

    cudnn_benchmark: bool = True
    """Let cuDNN autotune its convolutions on CUDA, as NVIDIA's and timm's training scripts do (the
    warm-up steps absorb the tuning)."""

    jsonl: Path | None = None
    """Append each finished row to this JSON Lines file at once."""

    resume: bool = False
    """Keep the finished rows already in ``jsonl`` and measure the rest. Rows measured under other
    settings (see :func:`~mixprec.measure.sweep.resume_key`) are refused, naming them."""

    resume_anyway: bool = False
    """With ``resume``, keep rows measured under other settings too."""

    def __post_init__(self) -> None:
        settle_policies(self)
        for name in ("channels_last", "compile"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                validation.one_of(name, value, CHOICES)
        if self.candidates is not None:
            object.__setattr__(self, "candidates", tuple(self.candidates))
            ok = all(isinstance(c, Candidate) for c in self.candidates)
            validation.require("candidates", self.candidates, ok, "mixprec.Candidate objects")
        ok = isinstance(self.baseline, Candidate | None)
        validation.require("baseline", self.baseline, ok, "a mixprec.Candidate")
        validation.optional_positive_int("batch_size", self.batch_size)
        validation.positive_int("accumulation_steps", self.accumulation_steps)
        validation.positive_int("steps", self.steps)
        validation.positive_int("warmup", self.warmup)
        validation.seconds("min_time_s", self.min_time_s)
        validation.fraction("settle", self.settle)
        validation.positive_int("settle_rounds", self.settle_rounds)
        validation.number_above("prune_factor", self.prune_factor, 1)
        validation.positive_int("nproc", self.nproc)
        if self.threads != "auto":
            validation.positive_int("threads", self.threads)
        if self.isolate is not None:
            validation.boolean("isolate", self.isolate)
        for name in ("cudnn_benchmark", "resume", "resume_anyway"):
            validation.boolean(name, getattr(self, name))
        if self.jsonl is not None:
            object.__setattr__(self, "jsonl", Path(self.jsonl))
        if self.accumulation_steps > 1 and self.nproc > 1:
            raise UsageError(
                "gradient accumulation on DDP ranks is not measured yet; drop nproc or accumulation."
            )

    @property
    def policy_names(self) -> list[str]:
        return parse_policies(self.policies)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (policies by canonical name, candidates by label, paths as
        strings)."""
        return validation.to_dict(self, policies=self.policy_names)
