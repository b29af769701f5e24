"""The decision: the fastest candidate whose numerics passed; ties within noise go to the safer one.

:func:`decide` is a pure function of measurements and verdicts, so it is tested on synthetic
numbers. Safer means simpler to live with: fp32 master weights beat half-precision storage, no
loss scaling beats loss scaling, NCHW beats a layout change, fewer fp32 islands beat more
(``PolicySpec.safety_rank`` orders the policies).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixprec.measure.race import Race
from mixprec.measure.results import BenchRow, baseline_row
from mixprec.numerics.results import CandidateCheck
from mixprec.policy import Candidate, PolicyConfig, get_policy
from mixprec.status import Status

Verdicts = Mapping[Candidate, CandidateCheck]  # keyed by Candidate.numerics


@dataclass(frozen=True)
class Ranked:
    """One row of tune's decision table: a measured candidate and what the decision made of it.

    Attributes:
        candidate: what was measured.
        status: recommended, passed, rejected, slower, unchecked, or the bench status
            (pruned, unsupported, oom, error).
        reason: why, in one sentence.
        verdict: the numerics verdict (pass/fail), None when not checked.
        row: the bench row with its figures (throughput, speedup, memory, MFU).
    """

    candidate: Candidate
    status: str
    reason: str
    verdict: str | None = None
    row: BenchRow | None = None

    @property
    def label(self) -> str:
        return self.candidate.label

    def to_dict(self) -> dict[str, Any]:
        row = self.row
        return {
            "label": self.label,
            "candidate": self.candidate.to_dict(),
            "policy": self.candidate.policy,
            "channels_last": self.candidate.channels_last,
            "keep_fp32": list(self.candidate.keep_fp32),
            "status": str(self.status),
            "verdict": self.verdict,
            "reason": self.reason,
            "throughput": row.throughput if row else None,
            "speedup_vs_fp32": row.speedup_vs_fp32 if row else None,
            "speedup_ci": list(row.speedup_ci) if row and row.speedup_ci else None,
            "step_time_ms": row.step_time_ms.to_dict() if row and row.step_time_ms else None,
            "peak_memory_bytes": row.peak_memory_bytes if row else None,
            "mfu": row.mfu if row else None,
            "compile_s": row.compile_s if row and self.candidate.compile else None,
            "graph_breaks": row.graph_breaks if row else None,
            "recompiles": row.recompiles if row else None,
            "compute_share": row.compute_share if row else None,
        }


@dataclass
class Recommendation:
    """The candidate tune recommends, with the evidence.

    Attributes:
        candidate: the pick.
        speedup_vs_fp32 / speedup_vs_tf32: its throughput over strict fp32's and tf32's.
        memory_saved_bytes: peak memory saved against strict fp32.
        margin: the numerics figures with the limits applied to them.
        reason: one paragraph: why it won and what lost.
        tie_break: set when a faster candidate within noise lost to this safer one.
        tied_with: that faster candidate.
        too_noisy: set when the machine's noise was too large to separate two candidates.
        noisy_with: the candidate the pick could not be separated from.
        lint_worth_fixing: lint findings of warning severity or worse under this policy.
        micro_batch / accumulation_steps: samples per forward/backward pass, and passes per optimizer
            step (set by tune: the candidate's own under ``--batch auto``, else the run's batch and 1).
        peak_memory_bytes: the pick's measured peak at that micro-batch.
    """

    candidate: Candidate
    speedup_vs_fp32: float | None
    speedup_vs_tf32: float | None
    memory_saved_bytes: int | None
    margin: dict[str, float | None]
    reason: str
    tie_break: str | None = None
    tied_with: Candidate | None = None
    too_noisy: str | None = None
    noisy_with: Candidate | None = None
    lint_worth_fixing: list[dict[str, Any]] = field(default_factory=list)
    micro_batch: int | None = None
    accumulation_steps: int = 1
    peak_memory_bytes: int | None = None

    @property
    def label(self) -> str:
        return self.candidate.label

    def config(self, device: str) -> PolicyConfig:
        """The policy configuration that reproduces the pick on ``device``."""
        return get_policy(self.candidate, device=device, check=False).config

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "candidate": self.candidate.to_dict(),
            "policy": self.candidate.policy,
            "channels_last": self.candidate.channels_last,
            "keep_fp32": list(self.candidate.keep_fp32),
            "speedup_vs_fp32": self.speedup_vs_fp32,
            "speedup_vs_tf32": self.speedup_vs_tf32,
            "memory_saved_bytes": self.memory_saved_bytes,
            "margin": self.margin,
            "reason": self.reason,
            "tie_break": self.tie_break,
            "tied_with": self.tied_with.label if self.tied_with else None,
            "tied_with_candidate": self.tied_with.to_dict() if self.tied_with else None,
            "too_noisy": self.too_noisy,
            "noisy_with": self.noisy_with.to_dict() if self.noisy_with else None,
            "lint_worth_fixing": self.lint_worth_fixing,
            "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "peak_memory_bytes": self.peak_memory_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recommendation:
        tied = data.get("tied_with_candidate")
        return cls(
            candidate=Candidate.from_dict(data.get("candidate") or data),
            speedup_vs_fp32=data.get("speedup_vs_fp32"),
            speedup_vs_tf32=data.get("speedup_vs_tf32"),
            memory_saved_bytes=data.get("memory_saved_bytes"),
            margin=data.get("margin") or {},
            reason=data.get("reason", ""),
            tie_break=data.get("tie_break"),
            tied_with=Candidate.from_dict(tied) if tied else None,
            too_noisy=data.get("too_noisy"),
            noisy_with=Candidate.from_dict(data["noisy_with"]) if data.get("noisy_with") else None,
            lint_worth_fixing=list(data.get("lint_worth_fixing") or []),
            micro_batch=data.get("micro_batch"),
            accumulation_steps=int(data.get("accumulation_steps") or 1),
            peak_memory_bytes=data.get("peak_memory_bytes"),
        )


def safety(row: BenchRow) -> tuple[int, int, int, int, int]:
    """Lower is simpler to live with: policy, then layout, fp32 islands, compilation (compile
    time, recompiles, graph breaks to maintain), then a non-default optimizer implementation."""
    c = row.candidate
    return (
        c.spec.safety_rank,
        int(c.channels_last),
        len(c.keep_fp32),
        int(bool(c.compile)) + int(c.compile_scope == "step"),  # a compiled step is more to maintain
        int(bool(c.optimizer)),
    )


def speed(row: BenchRow) -> float:
    """What candidates are ranked by: the speedup over strict fp32 (paired when measured so)."""
    return row.speedup_vs_fp32 or 0.0


def log_speed_se(row: BenchRow) -> float:
    """Standard error of log(speedup). Paired rows: the spread of their log paired ratios over
    sqrt(rounds). Unpaired rows (data-parallel, schema-1 files): from the step times' IQR
    (IQR ~ 1.35 sigma, se(median) ~ 1.25 sigma / sqrt(n), so ~0.93 * IQR / median / sqrt(n))."""
    ratios = [r for r in row.paired_ratios if r > 0]
    if len(ratios) >= 2:
        return statistics.stdev(math.log(r) for r in ratios) / math.sqrt(len(ratios))
    st = row.step_time_ms
    if not st or not st.median_ms or not st.n:
        return 0.0
    return 0.93 * (st.iqr_ms / st.median_ms) / math.sqrt(st.n)


# About 95% of the sampling noise of a difference lies within two standard errors.
Z = 2.0
# Beyond this relative uncertainty two candidates cannot be told apart on this machine: the
# decision says so instead of pretending a tie (or a winner) was measured.
NOISE_CAP = 0.25
# The verdicts that keep a candidate out of the recommendation, each shown as its row's status:
# a fail, a failure predicted within the run (at-risk), a format that never ran (error).
REJECTED = (Status.FAIL, Status.AT_RISK, Status.ERROR)


def noise_band(a: BenchRow, b: BenchRow, noise: float) -> float:
    """Relative speed difference between ``a`` and ``b`` that is not real: ``noise``, or two
    combined standard errors of their log speedups if larger (uncapped: compare with NOISE_CAP)."""
    return max(noise, math.expm1(Z * math.hypot(log_speed_se(a), log_speed_se(b))))


def within_noise(speedup: float, best: float, band: float) -> bool:
    return speedup >= best * (1 - min(band, NOISE_CAP))


def amortized(row: BenchRow, baseline: BenchRow | None, train_steps: int | None) -> float:
    """The speedup over a run of ``train_steps`` steps with compilation paid once: strict fp32
    takes N steps of t; the candidate takes its compile time plus N steps of t / speedup. Eager
    candidates (whose cold step costs about what fp32's does) keep their steady speedup."""
    s = speed(row)
    if not train_steps or not row.candidate.compile or not s or baseline is None:
        return s
    base_st, extra = baseline.step_time_ms, row.compile_s
    if base_st is None or not base_st.median_ms or extra is None:
        return s
    run_s = train_steps * base_st.median_ms / 1e3
    return run_s / (extra + run_s / s)


def decide(
    rows: Sequence[BenchRow],
    verdicts: Verdicts,
    *,
    noise: float = 0.03,
    train_steps: int | None = None,
    race: Race | None = None,
) -> tuple[Recommendation | None, list[Ranked]]:
    """The fastest candidate whose numerics passed; ties within noise go to the safer one.

    ``verdicts`` maps a candidate's :attr:`~mixprec.Candidate.numerics` to its check; strict
    fp32 is the reference and passes by definition. Candidates are ranked by their speedup over
    strict fp32 (the median paired ratio). ``noise`` is the smallest relative difference treated
    as real; two combined standard errors of the speedups widen it, up to :data:`NOISE_CAP`.
    When the measurement cannot separate the fastest candidate from a safer one within that
    cap, the recommendation says so (``too_noisy``) rather than calling a tie or a winner.
    With ``train_steps``, a compiled candidate's speedup is its :func:`amortized` one: its
    compile time is paid once over that many steps. A ``race`` (:mod:`mixprec.measure.race`) has
    the last word between the candidates it measured against each other: a resolved duel orders
    them whatever their fp32-relative figures say, a measured tie goes to the safer one, and only
    an unresolved duel can leave them "too noisy to separate".
    """
    measured = [r for r in rows if not r.baseline_repeat]
    fp32 = baseline_row(measured)

    def effective(row: BenchRow) -> float:
        return amortized(row, fp32, train_steps)

    passing, table = _rank(measured, verdicts, fp32, effective)
    if not passing:
        return None, table
    fastest = max(passing, key=effective)
    if race is not None:
        fastest = _race_leader(fastest, passing, race, fp32, train_steps)
    outcome = _outcomes(fastest, race)
    band = [
        r
        for r in passing
        if outcome(r) == "tie"
        or (
            outcome(r) in (None, "open")
            and within_noise(effective(r), effective(fastest), noise_band(r, fastest, noise))
        )
    ]
    chosen = min(band, key=safety)
    tie_break = _tie_break(chosen, fastest, race, effective)
    noisy_with, too_noisy = _too_noisy(passing, fastest, outcome, effective, noise)
    table = [
        Ranked(r.candidate, Status.RECOMMENDED, r.reason, r.verdict, r.row)
        if r.candidate == chosen.candidate
        else r
        for r in table
    ]
    verdict = verdicts.get(chosen.candidate.numerics)
    tf32 = max(
        (r for r in measured if r.policy == "tf32" and r.status == Status.OK),
        key=effective,
        default=None,
    )
    saved = None
    if fp32 and fp32.peak_memory_bytes and chosen.peak_memory_bytes:
        saved = fp32.peak_memory_bytes - chosen.peak_memory_bytes
    rec = Recommendation(
        candidate=chosen.candidate,
        speedup_vs_fp32=chosen.speedup_vs_fp32,
        speedup_vs_tf32=effective(chosen) / effective(tf32) if tf32 and effective(tf32) else None,
        memory_saved_bytes=saved,
        margin=_margin(verdict),
        reason=_reason(chosen, table, verdict, tie_break, too_noisy, fp32, train_steps, race),
        tie_break=tie_break,
        tied_with=fastest.candidate if tie_break else None,
        too_noisy=too_noisy,
        noisy_with=noisy_with.candidate if noisy_with is not None else None,
    )
    return rec, table


Speed = Callable[[BenchRow], float]


def _rank(
    measured: Sequence[BenchRow], verdicts: Verdicts, fp32: BenchRow | None, effective: Speed
) -> tuple[list[BenchRow], list[Ranked]]:
    """The rows that passed, and the decision table: one entry per measured row with its status."""
    passing: list[BenchRow] = []
    table: list[Ranked] = []
    for row in measured:
        verdict = verdicts.get(row.candidate.numerics)
        if row.status != Status.OK:
            table.append(Ranked(row.candidate, row.status, row.reason, row=row))
        elif row.policy == "fp32":
            # only the baseline row is the reference; fp32 compiled or channels_last is a candidate
            how = [f"compiled: {row.candidate.compile}"] if row.candidate.compile else []
            how += ["channels_last"] if row.channels_last else []
            how += [f"{row.candidate.optimizer} optimizer"] if row.candidate.optimizer else []
            if row is fp32:
                why = "the strict fp32 reference"
            elif row.candidate.as_written:
                why = "the script as written: fp32 numerics"
            else:
                why = f"fp32 numerics ({', '.join(how)})"
            table.append(Ranked(row.candidate, Status.PASS, why, Status.PASS, row))
            passing.append(row)
        elif verdict is None:
            slower = fp32 is not None and effective(row) <= 1.0
            table.append(
                Ranked(
                    row.candidate,
                    Status.SLOWER if slower else Status.UNCHECKED,
                    "not faster than strict fp32"
                    if slower
                    else "numerics not checked: a faster candidate passed first, or the budget ran out",
                    row=row,
                )
            )
        else:
            ok = verdict.verdict == Status.PASS
            rejected = verdict.verdict if verdict.verdict in REJECTED else Status.FAIL
            table.append(
                Ranked(row.candidate, Status.PASS if ok else rejected, verdict.reason, verdict.verdict, row)
            )
            if ok:
                passing.append(row)
    return passing, table


def _outcomes(fastest: BenchRow, race: Race | None) -> Callable[[BenchRow], str | None]:
    """How a row did against ``fastest`` in a direct race, as seen from it: 'tie', 'faster',
    'slower', 'open' (unresolved); None where the two never raced."""

    def outcome(r: BenchRow) -> str | None:
        duel = race.duel(fastest.candidate, r.candidate) if race is not None else None
        if duel is None or r is fastest:
            return None
        if duel.outcome == "tie":
            return "tie"
        ahead = duel.ahead()
        return "open" if ahead is None else "faster" if ahead == r.candidate else "slower"

    return outcome


def _tie_break(chosen: BenchRow, fastest: BenchRow, race: Race | None, effective: Speed) -> str | None:
    """Why ``chosen`` won over the faster ``fastest`` (a measured tie, or within the noise); None
    when the fastest won."""
    if chosen is fastest:
        return None
    duel = race.duel(fastest.candidate, chosen.candidate) if race is not None else None
    if duel is not None and duel.outcome == "tie":
        return (
            f"{fastest.label} and {chosen.label} measured against each other: {duel.describe()}; "
            f"{chosen.label} is simpler/safer, so it is preferred"
        )
    gap = 1 - effective(chosen) / (effective(fastest) or 1)
    return (
        f"{fastest.label} measured {gap:.1%} faster than {chosen.label}, within measurement noise; "
        f"{chosen.label} is simpler/safer, so it is preferred"
    )


def _too_noisy(
    passing: Sequence[BenchRow],
    fastest: BenchRow,
    outcome: Callable[[BenchRow], str | None],
    effective: Speed,
    noise: float,
) -> tuple[BenchRow | None, str | None]:
    """The first passing row the measurement could not separate from ``fastest`` (uncertain beyond
    :data:`NOISE_CAP`, never raced to a result, intervals overlapping), and what to say of it."""
    for r in passing:
        uncertainty = noise_band(r, fastest, noise)
        if (
            r is not fastest
            and outcome(r) in (None, "open")
            and uncertainty > NOISE_CAP
            and effective(r) < effective(fastest) * (1 - NOISE_CAP)
            and not _separated(r, fastest)
        ):
            return r, (
                f"too noisy to separate {fastest.label} ({effective(fastest):.2f}x) and {r.label} "
                f"({effective(r):.2f}x): their speedups are uncertain by +-{uncertainty:.0%} "
                "here; rerun on a quiet machine"
            )
    return None, None


def _margin(verdict: Any) -> dict[str, float | None]:
    """The figures with the limits that were applied to them (SQNR floors and the loss allowance
    adapt to how much this model amplifies noise, see docs/check.md)."""
    return {
        "output_sqnr_db": verdict.output_sqnr_db if verdict else None,
        "output_sqnr_db_limit": verdict.required_output_sqnr_db if verdict else None,
        "grad_sqnr_db": verdict.total_grad_sqnr_db if verdict else None,
        "grad_sqnr_db_limit": verdict.required_grad_sqnr_db if verdict else None,
        "max_rel_loss_diff": verdict.max_rel_loss_diff if verdict else None,
        "max_rel_loss_diff_limit": verdict.allowed_rel_loss_diff if verdict else None,
    }


def _separated(slower: BenchRow, faster: BenchRow) -> bool:
    """The two speedups' 95% intervals do not overlap: measured apart, however wide each is."""
    a, b = slower.speedup_ci, faster.speedup_ci
    return a is not None and b is not None and a[1] < b[0]


def _race_leader(
    fastest: BenchRow, passing: Sequence[BenchRow], race: Race, fp32: BenchRow | None, train_steps: int | None
) -> BenchRow:
    """The race's leader among the passing rows when it is one of them (a resolved duel beats the
    fp32-relative ranking); the fp32-relative fastest otherwise. Compilation is paid once over
    ``train_steps``: a compiled leader that only wins per step must win amortized too."""
    leader = next((r for r in passing if r.candidate == race.leader), None)
    if leader is None or leader is fastest:
        return fastest
    duel = race.duel(fastest.candidate, leader.candidate)
    if duel is None or duel.ahead() != leader.candidate or duel.ratio is None:
        return fastest
    if not speed(leader) or not speed(fastest):
        return leader
    # the race leader's per-step speed over the fastest's, with each one's compile time spread
    # over the run
    per_step = duel.ratio if duel.rival == leader.candidate else 1 / duel.ratio
    spread = amortized(leader, fp32, train_steps) / speed(leader)
    factor = spread / (amortized(fastest, fp32, train_steps) / speed(fastest))
    return leader if per_step * factor > 1 else fastest


def _reason(
    chosen: BenchRow,
    table: list[Ranked],
    verdict: CandidateCheck | None,
    tie: str | None,
    too_noisy: str | None,
    fp32: BenchRow | None = None,
    train_steps: int | None = None,
    race: Race | None = None,
) -> str:
    parts = [f"{r.label} rejected: {r.reason}" for r in table if r.status in REJECTED]
    pruned = [r.label for r in table if r.status == Status.PRUNED]
    if pruned:
        parts.append(f"{', '.join(pruned)} pruned as far slower than the best")
    how_fast = "measured"
    if chosen.speedup_vs_fp32:
        ci = chosen.speedup_ci
        interval = f" (95% interval {ci[0]:.2f}-{ci[1]:.2f}x)" if ci else ""
        how_fast = f"{chosen.speedup_vs_fp32:.2f}x faster than strict fp32{interval}"
        if chosen.candidate.compile and chosen.compile_s is not None and train_steps:
            how_fast += (
                f" per step, {amortized(chosen, fp32, train_steps):.2f}x over {train_steps} steps "
                f"after {chosen.compile_s:.0f} s of compilation"
            )
    if chosen.policy == "fp32":
        parts.append(
            "no lower-precision candidate both beat strict fp32 and passed the numerics check: stay in fp32"
        )
    else:
        match = ""
        if verdict is not None and verdict.max_rel_loss_diff is not None:
            match = f" and matches its loss within {verdict.max_rel_loss_diff:.2%} over the checked steps"
        islands = f" with {', '.join(chosen.keep_fp32)} kept in fp32" if chosen.keep_fp32 else ""
        parts.append(f"{chosen.label}{islands} is {how_fast}{match}")
    if tie:
        parts.append(tie)
    elif race is not None:  # how the pick fared against the finalists, measured head to head
        parts += [f"raced: {d.describe()}" for d in race.duels if chosen.candidate in (d.leader, d.rival)]
    if too_noisy:
        parts.append(too_noisy)
    return "; ".join(parts) + "."
