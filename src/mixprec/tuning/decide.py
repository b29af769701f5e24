"""The decision: the fastest resolved candidate whose numerics passed; ties within noise go to the
safer one, never to one measured slower than another passing candidate.

:func:`decide` is a pure function of measurements and verdicts, so it is tested on synthetic
numbers (property tests in ``tests/tuning/test_decide_resolved.py``). It works from what is
resolved: a passing candidate whose own speedup is uncertain beyond :data:`NOISE_CAP` (and that no
race resolved) is *noisy*: set aside and named for a re-measure, never the reference a tie-break is
measured against, unless it is measured faster than the fastest resolved one (then it can be the pick).
What a speedup is and how well it is known: :mod:`mixprec.tuning.speedups`.

Safer means simpler to live with: fp32 master weights beat half-precision storage, no loss scaling
beats loss scaling, NCHW beats a layout change, fewer fp32 islands beat more
(``PolicySpec.safety_rank`` orders the policies); a safer candidate whose interval lies entirely
below another passing candidate's (:func:`dominates`) is never preferred. What was not
measured (the budget ended first) or only predicted (fp8 on hardware without it) are rows of the
table too (:class:`Untried`), and the recommendation says what trying them would take.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixprec.budget import what_ended
from mixprec.measure.race import Race
from mixprec.measure.results import BenchRow, baseline_row, spared_said
from mixprec.numerics.results import CandidateCheck
from mixprec.policy import Candidate, PolicyConfig, get_policy
from mixprec.status import Status
from mixprec.tuning.speedups import (
    NOISE_CAP,
    Speed,
    amortized,
    dominates,
    faster_beyond_noise,
    interval,
    interval_band,
    noise_band,
    raw_interval,
    speed,
    uncertainty,
    within_noise,
)

Verdicts = Mapping[Candidate, CandidateCheck]  # keyed by Candidate.numerics


def _candidate_keys(candidate: Candidate) -> dict[str, Any]:
    """The keys a decision table row and the recommendation open their JSON with: the candidate's
    label, the candidate itself, and its policy, channels_last and keep_fp32 at the top level."""
    return {
        "label": candidate.label,
        "candidate": candidate.to_dict(),
        "policy": candidate.policy,
        "channels_last": candidate.channels_last,
        "keep_fp32": list(candidate.keep_fp32),
    }


@dataclass(frozen=True)
class Untried:
    """A candidate tune planned but did not measure: its row in the decision table.

    Attributes:
        candidate: what was not measured.
        status: ``not-measured`` (the budget ended before it) or ``predicted`` (its numerics were
            predicted here; its speed cannot be measured on this device).
        reason: why, in one sentence ("not measured: the speed sweep stopped at the deadline").
        cost_s: about what measuring (and checking) it would take, from what the candidates measured
            so far cost; None where unknown or not a matter of budget.
        verdict: a prediction's verdict (pass/fail), None otherwise.
    """

    candidate: Candidate
    status: str
    reason: str
    cost_s: float | None = None
    verdict: str | None = None


@dataclass(frozen=True)
class Ranked:
    """One row of tune's decision table: a measured candidate and what the decision made of it.

    Attributes:
        candidate: what was measured.
        status: recommended, pass, fail, at-risk, slower, unchecked, noisy (passed, too uncertain
            to rank: set aside for a re-measure), not-measured (the budget ended first), predicted
            (numerics only), or the bench status (pruned, unsupported, oom, error).
        reason: why, in one sentence.
        verdict: the numerics verdict (pass/fail), None when not checked.
        row: the bench row with its figures (throughput, speedup, memory, MFU); None for a
            candidate that was not measured.
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
            **_candidate_keys(self.candidate),
            "status": str(self.status),
            "verdict": self.verdict,
            "reason": self.reason,
            "throughput": row.throughput if row else None,
            "speedup_vs_fp32": row.speedup_vs_fp32 if row else None,
            "speedup_ci": list(row.speedup_ci) if row and row.speedup_ci else None,
            "repeat_ci": list(row.repeat_ci) if row and row.repeat_ci else None,
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
        too_noisy: set when passing candidates were too noisy to rank: which, and that they were set
            aside (re-measured when the budget allows).
        noisy_with: the first of them (the most promising).
        remeasure: every noisy candidate that could still beat the pick, and the pick itself where
            it is noisy (chosen as measured apart above the rest): what tune re-measures.
        untried: set when candidates were not measured because the budget ended: which (the
            precisions of which nothing ran first) and the budget that would try them.
        budget_to_try_s: that budget in seconds: the run's budget plus what the untried
            candidates would cost, from what the measured ones cost.
        numerics_unverified: set when the pick's numerics check was inconclusive (the fp32
            reference did not learn over the checked steps): why; the pick is then on speed alone.
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
    remeasure: tuple[Candidate, ...] = ()
    untried: str | None = None
    budget_to_try_s: float | None = None
    numerics_unverified: str | None = None
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
            **_candidate_keys(self.candidate),
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
            "remeasure": [c.to_dict() for c in self.remeasure],
            "untried": self.untried,
            "budget_to_try_s": self.budget_to_try_s,
            "numerics_unverified": self.numerics_unverified,
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
            remeasure=tuple(Candidate.from_dict(c) for c in data.get("remeasure") or ()),
            untried=data.get("untried"),
            budget_to_try_s=data.get("budget_to_try_s"),
            numerics_unverified=data.get("numerics_unverified"),
            lint_worth_fixing=list(data.get("lint_worth_fixing") or []),
            micro_batch=data.get("micro_batch"),
            accumulation_steps=int(data.get("accumulation_steps") or 1),
            peak_memory_bytes=data.get("peak_memory_bytes"),
        )


def safety(row: BenchRow) -> tuple[int, int, int, int, int, int]:
    """Lower is simpler to live with: a script as written (nothing to change), then policy, layout,
    fp32 islands, compilation (compile time, recompiles, graph breaks to maintain), then a
    non-default optimizer implementation."""
    c = row.candidate
    return (
        int(not c.as_written),
        c.spec.safety_rank,
        int(c.channels_last),
        len(c.keep_fp32),
        int(bool(c.compile)) + int(c.compile_scope == "step"),  # a compiled step is more to maintain
        int(bool(c.optimizer)),
    )


# The verdicts that keep a candidate out of the recommendation, each shown as its row's status:
# a fail, a failure predicted within the run (at-risk), a format that never ran (error).
REJECTED = (Status.FAIL, Status.AT_RISK, Status.ERROR)
# The decision table names at most this many untried candidates in one sentence.
NAMED = 6


@dataclass(frozen=True)
class _Judge:
    """What the decision knows of the passing rows: which are resolved, which dominate which."""

    fp32: BenchRow | None
    effective: Speed
    noise: float
    race: Race | None

    def raced(self, row: BenchRow) -> bool:
        """A race measured ``row`` head to head and resolved the duel (a tie counts)."""
        race = self.race
        return race is not None and any(
            d.resolved and row.candidate in (d.leader, d.rival) for d in race.duels
        )

    def noisy(self, row: BenchRow) -> bool:
        """Too uncertain on its own to rank, and no race resolved it."""
        if row is self.fp32 or speed(row) <= 0:
            return False
        return uncertainty(row) > NOISE_CAP and not self.raced(row)

    def dominates(self, faster: BenchRow, slower: BenchRow) -> bool:
        return dominates(
            faster, slower, self.noise, effective=self.effective, race=self.race, reference=self.fp32
        )

    def apart(self, faster: BenchRow, slower: BenchRow) -> bool:
        """``faster`` is measured faster than ``slower``: its interval lies above (or their race
        says so), or, where ``faster`` is noisy, its figure clears their combined noise
        (:func:`faster_beyond_noise`): a noisy row's own figure is uncertain, not unknown."""
        if self.dominates(faster, slower):
            return True
        duel = self.race.duel(faster.candidate, slower.candidate) if self.race is not None else None
        # (a duel's head-to-head rounds outrank two fp32-relative figures, even one left open)
        if (duel is not None and duel.ahead() is not None) or not self.noisy(faster):
            return False
        return faster_beyond_noise(faster, slower, self.noise, effective=self.effective, reference=self.fp32)

    def interval(self, row: BenchRow) -> tuple[float, float]:
        s = speed(row)
        scale = self.effective(row) / s if s else 1.0
        return interval(row, self.noise, scale=scale, reference=row is self.fp32)


def decide(
    rows: Sequence[BenchRow],
    verdicts: Verdicts,
    *,
    noise: float = 0.03,
    train_steps: int | None = None,
    race: Race | None = None,
    untried: Sequence[Untried] = (),
    not_checked: Mapping[Candidate, str] | None = None,
    budget_s: float | None = None,
    interrupted: bool = False,
) -> tuple[Recommendation | None, list[Ranked]]:
    """The fastest resolved candidate whose numerics passed; ties within noise go to the safer one.

    ``verdicts`` maps a candidate's :attr:`~mixprec.Candidate.numerics` to its check; strict
    fp32 is the reference and passes by definition. Candidates are ranked by their speedup over
    strict fp32 (the median paired ratio). With ``train_steps``, a compiled candidate's speedup is
    its :func:`amortized` one: its compile time is paid once over that many steps.

    The decision works from what is resolved. A passing candidate whose own speedup is uncertain
    beyond :data:`NOISE_CAP` (:func:`uncertainty`) and that no race resolved is *noisy*: set aside
    (status ``noisy``, listed in ``remeasure`` where it could beat the pick), never the reference of
    a tie-break. Among the resolved ones the fastest wins, unless a safer one is within the noise
    of that pair: ``noise`` is the smallest relative difference treated as real; two combined
    standard errors widen it, up to :data:`NOISE_CAP`. A safer candidate never wins when its
    interval lies entirely below another passing candidate's (:func:`dominates`), nor when it is
    slower than a candidate the race measured slower than the fastest. Where a noisy candidate is
    measured faster than the fastest resolved one (its interval lies entirely above, or its figure
    clears theirs by more than their combined noise: :func:`~mixprec.tuning.speedups.faster_beyond_noise`,
    unless a duel of the race has the other ahead), it is faster whatever its noise and the pick is
    among such candidates.

    A ``race`` (:mod:`mixprec.measure.race`) has the last word between the candidates it measured
    against each other: a resolved duel orders them whatever their fp32-relative figures say, a
    measured tie goes to the safer one.

    ``untried``: candidates planned but not measured (the budget ended first) or only predicted,
    each a row of the table; with ``budget_s`` (the run's budget) the recommendation names the
    budget that would try them; ``interrupted``: a signal ended the run first (no budget is named
    then). ``not_checked``: why a measured candidate's numerics were not checked (keyed by its
    numerics), where the budget ended first.
    """
    measured = [r for r in rows if not r.baseline_repeat]
    fp32 = baseline_row(measured)

    def effective(row: BenchRow) -> float:
        return amortized(row, fp32, train_steps)

    passing, table = _rank(measured, verdicts, fp32, effective, not_checked or {})
    seen = {r.candidate for r in measured}
    untried = [u for u in untried if u.candidate not in seen]
    table += [Ranked(u.candidate, u.status, u.reason, u.verdict) for u in untried]
    if not passing:
        return None, table
    judge = _Judge(fp32, effective, noise, race)
    resolved = [r for r in passing if not judge.noisy(r)] or list(passing)
    by_rows = fastest = max(resolved, key=effective)
    if race is not None:
        fastest = _race_leader(fastest, resolved, race, fp32, train_steps)
    chosen, band = _choose(fastest, resolved, passing, judge)
    beaten = fastest if chosen is not fastest else by_rows  # (within noise, or what the race beat)
    tie_break = _tie_break(chosen, beaten, race, effective) if band or chosen is fastest else None
    above = None if band else _above(chosen, fastest, judge)
    rivals = sorted(
        (
            r
            for r in passing
            if r is not chosen and judge.noisy(r) and judge.interval(r)[1] > effective(chosen)
        ),
        key=effective,
        reverse=True,
    )
    too_noisy = _too_noisy(rivals, chosen, judge)
    remeasure = [chosen, *rivals] if judge.noisy(chosen) else rivals  # a noisy pick: its figure too
    untried_text, budget_to_try = _untried(untried, measured, budget_s, interrupted)
    noisy = {r.candidate for r in passing if r is not chosen and judge.noisy(r)}
    table = [
        Ranked(r.candidate, Status.RECOMMENDED, r.reason, r.verdict, r.row)
        if r.candidate == chosen.candidate
        else Ranked(r.candidate, Status.NOISY, _noisy_reason(r.row, r.row in rivals), r.verdict, r.row)
        if r.candidate in noisy and r.row is not None
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
    reason = _reason(
        chosen,
        table,
        verdict,
        tie_break,
        too_noisy,
        fp32,
        train_steps,
        race,
        above=above,
        untried=untried_text,
        interrupted=interrupted,
    )
    rec = Recommendation(
        candidate=chosen.candidate,
        speedup_vs_fp32=chosen.speedup_vs_fp32,
        speedup_vs_tf32=effective(chosen) / effective(tf32) if tf32 and effective(tf32) else None,
        memory_saved_bytes=saved,
        margin=_margin(verdict),
        reason=reason,
        tie_break=tie_break,
        tied_with=beaten.candidate if tie_break else None,
        too_noisy=too_noisy,
        noisy_with=rivals[0].candidate if rivals else None,
        remeasure=tuple(r.candidate for r in remeasure),
        untried=untried_text,
        budget_to_try_s=budget_to_try,
        numerics_unverified=unverified(verdict),
    )
    return rec, table


def unverified(verdict: CandidateCheck | None) -> str | None:
    """Why a pick's numerics are not verified (its check was inconclusive), or None."""
    if verdict is None or verdict.verdict != Status.INCONCLUSIVE:
        return None
    why = verdict.reason.removeprefix(f"{Status.INCONCLUSIVE}: ").split(" (its figures:")[0]
    return f"numerics not verified: {why}"


def _choose(
    fastest: BenchRow, resolved: Sequence[BenchRow], passing: Sequence[BenchRow], judge: _Judge
) -> tuple[BenchRow, list[BenchRow]]:
    """The pick and the band it was chosen from (empty when a noisy candidate is measured faster
    than the fastest resolved one, :meth:`_Judge.apart`: the pick is then among those)."""
    effective, race = judge.effective, judge.race
    outcome = _outcomes(fastest, race)
    # a candidate the race measured slower than the fastest bounds the band: whatever is slower
    # than it is slower than the fastest too, however noisy the fastest's fp32-relative figure
    beaten = [r for r in resolved if outcome(r) == "slower"]

    def in_band(r: BenchRow) -> bool:
        if r is fastest or outcome(r) == "tie":
            return True
        if outcome(r) not in (None, "open") or any(effective(r) <= effective(b) for b in beaten):
            return False
        return within_noise(effective(r), effective(fastest), noise_band(r, fastest, judge.noise))

    band = [r for r in resolved if in_band(r) and not any(judge.apart(d, r) for d in passing)]
    above = [d for d in passing if judge.apart(d, fastest)]
    if band and not any(judge.noisy(d) for d in above):
        return min(band, key=safety), band
    # every candidate of the band lies below another passing one, or a noisy candidate is measured
    # faster than the fastest resolved one: the pick is among those measured faster than the fastest
    # that nothing is measured faster than in turn
    top = [d for d in above if not any(judge.apart(e, d) for e in passing)] or above or [fastest]
    return min(top, key=safety), []


def _above(chosen: BenchRow, fastest: BenchRow, judge: _Judge) -> str:
    """Why the pick beat the fastest well-measured candidate: measured faster (:meth:`_Judge.apart`)."""
    flo, fhi = judge.interval(fastest)
    rival = f"{fastest.label}, the fastest well-measured candidate"
    if judge.dominates(chosen, fastest):
        lo, hi = judge.interval(chosen)
        return (
            f"{chosen.label}'s 95% interval ({lo:.2f}-{hi:.2f}x) lies entirely above that of {rival} "
            f"({flo:.2f}-{fhi:.2f}x): it is faster however noisy its own figure"
        )
    gain = judge.effective(chosen) / judge.effective(fastest) - 1
    band = interval_band(chosen, fastest, judge.noise, reference=judge.fp32)
    return (
        f"{chosen.label} is {gain:.0%} faster than {rival} ({judge.effective(fastest):.2f}x, "
        f"{flo:.2f}-{fhi:.2f}x), more than the {band:.0%} their two figures' noise spans: faster, its "
        "own noise counted"
    )


def _noisy_reason(row: BenchRow, rival: bool) -> str:
    """A noisy row's reason: its interval, and whether it could still beat the pick (re-measured)."""
    lo, hi = raw_interval(row, False)
    then = "re-measured when the budget allows" if rival else "even its interval's top is below the pick"
    return (
        f"too noisy to rank: {speed(row):.2f}x, 95% interval {lo:.2f}-{hi:.2f}x "
        f"(+-{uncertainty(row):.0%}, beyond {NOISE_CAP:.0%}); set aside, {then}"
    )


def _untried(
    untried: Sequence[Untried], measured: Sequence[BenchRow], budget_s: float | None, interrupted: bool
) -> tuple[str | None, float | None]:
    """What the budget (or an interrupt) left unmeasured, in one sentence, and the budget that would
    try it: the run's budget plus what the untried candidates would cost, from what the measured
    ones cost (none after an interrupt: a larger budget is not what they lacked)."""
    missing = [u for u in untried if u.status == Status.NOT_MEASURED]
    if not missing:
        return None, None
    ran = {r.policy for r in measured if r.status == Status.OK}
    families = list(dict.fromkeys(u.candidate.policy for u in missing if u.candidate.policy not in ran))
    labels = [u.candidate.label for u in missing]
    named = ", ".join(labels[:NAMED]) + (f" and {len(labels) - NAMED} more" if len(labels) > NAMED else "")
    ended = what_ended(interrupted)
    text = f"not measured because {ended} first: {named}"
    if families:
        text += f" (nothing in {', '.join(families)} ran)"
    costs = [u.cost_s for u in missing if u.cost_s]
    budget = None
    if costs and budget_s and not interrupted:
        budget = float(10 * math.ceil((budget_s + sum(costs)) / 10))
        text += f"; about --budget {budget:g} would try them"
    return text, budget


def _rank(
    measured: Sequence[BenchRow],
    verdicts: Verdicts,
    fp32: BenchRow | None,
    effective: Speed,
    not_checked: Mapping[Candidate, str],
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
                    else not_checked.get(
                        row.candidate.numerics,
                        "numerics not checked: a faster candidate passed first, or the budget ran out",
                    ),
                    row=row,
                )
            )
        else:
            # an inconclusive verdict (the reference did not learn) may still win on speed, labelled
            ok = verdict.acceptable
            rejected = verdict.verdict if verdict.verdict in REJECTED else Status.FAIL
            status = verdict.verdict if ok else rejected
            table.append(Ranked(row.candidate, status, verdict.reason, verdict.verdict, row))
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
    """Why ``chosen`` won over ``fastest``, faster by its figure against strict fp32 (a measured tie,
    their race, or within the noise); None when the fastest won."""
    if chosen is fastest:
        return None
    duel = race.duel(fastest.candidate, chosen.candidate) if race is not None else None
    if duel is not None and duel.outcome == "tie":
        return (
            f"{fastest.label} and {chosen.label} measured against each other: {duel.describe()}; "
            f"{chosen.label} is simpler/safer, so it is preferred"
        )
    gap = 1 - effective(chosen) / (effective(fastest) or 1)
    if duel is not None and duel.ahead() == chosen.candidate:  # (the race's leader, kept ahead)
        return (
            f"{fastest.label} measured {gap:.1%} faster than {chosen.label} against strict fp32, but "
            f"measured against each other {duel.describe()}; the direct comparison decides"
        )
    return (
        f"{fastest.label} measured {gap:.1%} faster than {chosen.label}, within measurement noise; "
        f"{chosen.label} is simpler/safer, so it is preferred"
    )


def _too_noisy(remeasure: Sequence[BenchRow], chosen: BenchRow, judge: _Judge) -> str | None:
    """What to say of the noisy candidates that could still beat the pick: set aside, not ranked."""
    if not remeasure:
        return None
    named = ", ".join(
        f"{r.label} ({judge.effective(r):.2f}x, 95% interval {lo:.2f}-{hi:.2f}x)"
        for r in remeasure
        for lo, hi in [judge.interval(r)]
    )
    return (
        f"too noisy to separate {named} from {chosen.label} ({judge.effective(chosen):.2f}x): uncertain "
        f"beyond +-{NOISE_CAP:.0%}, so set aside rather than ranked (re-measured when the budget allows); "
        "rerun on a quiet machine for a firmer answer"
    )


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
    *,
    above: str | None = None,
    untried: str | None = None,
    interrupted: bool = False,
) -> str:
    parts = [f"{r.label} rejected: {r.reason}" for r in table if r.status in REJECTED]
    pruned = [r for r in table if r.status == Status.PRUNED]
    if slow := [r.label for r in pruned if not (r.row and r.row.spared)]:
        parts.append(f"{', '.join(slow)} pruned as far slower than the best")
    if spared := [r.row for r in pruned if r.row and r.row.spared]:
        parts.append(spared_said(spared))
    how_fast = "measured"
    if chosen.speedup_vs_fp32:
        ci = chosen.interval
        interval = f" (95% interval {ci[0]:.2f}-{ci[1]:.2f}x)" if ci else ""
        how_fast = f"{chosen.speedup_vs_fp32:.2f}x faster than strict fp32{interval}"
        if chosen.candidate.compile and chosen.compile_s is not None and train_steps:
            how_fast += (
                f" per step, {amortized(chosen, fp32, train_steps):.2f}x over {train_steps} steps "
                f"after {chosen.compile_s:.0f} s of compilation"
            )
    if chosen.policy == "fp32" and untried and fp32_by_default(table):
        ended = what_ended(interrupted)
        parts.append(
            f"no lower-precision candidate was measured before {ended}: strict fp32 by default, "
            "not by measurement"
        )
    elif chosen.policy == "fp32":
        parts.append(
            "no lower-precision candidate both beat strict fp32 and passed the numerics check: stay in fp32"
        )
    else:
        match = ""
        if verdict is not None and verdict.max_rel_loss_diff is not None:
            match = f" and matches its loss within {verdict.max_rel_loss_diff:.2%} over the checked steps"
            if verdict.randomness:
                match += f" ({verdict.randomness})"
        unchecked = unverified(verdict)
        if unchecked:  # on speed alone: the comparison had no power
            match = f"; {unchecked}"
        islands = f" with {', '.join(chosen.keep_fp32)} kept in fp32" if chosen.keep_fp32 else ""
        parts.append(f"{chosen.label}{islands} is {how_fast}{match}")
    if above:
        parts.append(above)
    if tie:
        parts.append(tie)
    elif race is not None:  # how the pick fared against the finalists, measured head to head
        parts += [f"raced: {d.describe()}" for d in race.duels if chosen.candidate in (d.leader, d.rival)]
    if too_noisy:
        parts.append(too_noisy)
    if untried:
        parts.append(untried)
    return "; ".join(parts) + "."


_RAN = (Status.OK, Status.PRUNED, Status.OOM, Status.ERROR)  # a row whose candidate (or a sibling) ran


def fp32_by_default(table: Sequence[Ranked]) -> bool:
    """Strict fp32 stands by default, not by measurement: the budget left a lower precision
    unmeasured and none ran. One that ran and lost (pruned as hopeless against the fastest so far,
    as bf16 is on a CPU that only emulates it) settles it by measurement, whatever fp32 variants
    (compiled, re-measured) the budget left."""
    lower = [r for r in table if r.candidate.policy != "fp32"]
    ran = any(r.row is not None and r.row.status in _RAN for r in lower)
    return not ran and any(r.status == Status.NOT_MEASURED for r in lower)
