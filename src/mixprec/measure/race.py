"""A race among finalists: each rival paired with the leader itself, round after round, until the
difference is resolved, measured to be a tie, or the budget ends it.

Ranking candidates by their speedups over strict fp32 divides each by its *own* neighbouring fp32
rounds: when fp32 drifts during a sweep (15% was seen on a shared CPU), two candidates 19% apart
can look equal, and the two finalists were never compared with each other. Here the leader is the
reference of a paired sweep (:class:`~mixprec.measure.paired.PairedSweep`), so each round's ratio
is the leader's step time over the rival's, measured back to back.

Successive halving: every rival gets a first batch of rounds; only those whose interval still
straddles the noise floor get more (twice as many, up to a cap), so the measuring goes where the
answer is still open. A rival found faster becomes the leader and the rest race it. A tie is
declared only when the interval lies within the noise floor, never because the time ran out
(that is "unresolved").
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mixprec.budget import Budget
from mixprec.events import Events
from mixprec.frameworks import Framework
from mixprec.frameworks.session import BenchSettings
from mixprec.measure.isolate import SessionEnded
from mixprec.measure.paired import BaselineEnded, PairedSweep
from mixprec.measure.repeats import widen
from mixprec.measure.results import median_ci
from mixprec.policy import Candidate
from mixprec.status import Status

FIRST_ROUNDS = 4  # paired rounds every rival gets
MAX_ROUNDS = 24  # rounds a rival may get in all before its duel is called unresolved


@dataclass(frozen=True)
class Duel:
    """Two candidates measured against each other.

    Attributes:
        leader / rival: the pair; ``ratios`` are the leader's step time over the rival's, per paired
            round (above 1: the rival is faster).
        noise: the noise floor: a relative difference below it is a tie.
        between_run_sd: the spread between runs of log(speedup) on this machine
            (:mod:`mixprec.measure.repeats`; 0: not known). The duel is decided on its own rounds;
            this says where a repeat in fresh processes lands (:attr:`repeat_interval`).
    """

    leader: Candidate
    rival: Candidate
    ratios: tuple[float, ...] = ()
    noise: float = 0.03
    between_run_sd: float = 0.0

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def interval(self) -> tuple[float, float] | None:
        return median_ci(self.ratios)

    @property
    def repeat_interval(self) -> tuple[float, float] | None:
        """Where the ratio of a repeat of this duel in fresh processes lands, 19 times in 20: the
        rounds' interval widened by the spread between runs, as a speedup's is. One pair of
        processes shares its memory layout and thread placement over all its rounds: on the 2-core
        EPYC, ResNet-50's compiled step against eager channels_last raced 10.0% faster
        [+7.0% to +14.4%] in one pair, and +0.7% to +10.4% in seven pairs more
        (``benchmarks/race_pairs.py``). None when the spread between runs is not known."""
        ci, ratio = self.interval, self.ratio
        if ci is None or not ratio or self.between_run_sd <= 0:
            return None
        return widen(ratio, ci, self.between_run_sd)

    @property
    def outcome(self) -> str:
        """'rival faster', 'leader faster', 'tie' (the interval within the noise floor) or 'unresolved'."""
        ci = self.interval
        if ci is None:
            return "unresolved"
        low, high = ci
        if low >= 1 - self.noise and high <= 1 + self.noise:
            return "tie"  # whatever the difference is, it is below the noise floor
        if low > 1 + self.noise:
            return "rival faster"
        if high < 1 - self.noise:
            return "leader faster"
        if len(self.ratios) >= MAX_ROUNDS:  # out of rounds: call it where the interval excludes 1
            return "rival faster" if low > 1 else "leader faster" if high < 1 else "unresolved"
        return "unresolved"

    @property
    def resolved(self) -> bool:
        return self.outcome != "unresolved"

    def faster(self) -> Candidate | None:
        """The candidate measured faster, None for a tie or an open duel."""
        return {"rival faster": self.rival, "leader faster": self.leader}.get(self.outcome)

    def ahead(self) -> Candidate | None:
        """The candidate ahead: the one measured faster, or in a duel the budget left open, the one
        its median favours (the best evidence there is); None for a tie or no rounds. Only a tie
        measured within the noise floor lets the safer candidate win."""
        faster = self.faster()
        if faster is not None or self.outcome == "tie" or not self.ratio or self.ratio == 1:
            return faster
        return self.rival if self.ratio > 1 else self.leader

    def describe(self) -> str:
        """E.g. "bf16-true ran 11.2% faster than bf16-mixed [+9.0% to +13.6%] over 8 paired rounds"."""
        ratio, ci, n = self.ratio, self.interval, len(self.ratios)
        if ratio is None:
            return f"{self.rival.label} vs {self.leader.label}: not measured"
        outcome = self.outcome
        if outcome == "leader faster":  # say it from the winner's side
            fast, slow, gain = self.leader, self.rival, 1 / ratio - 1
            spread = (1 / ci[1] - 1, 1 / ci[0] - 1) if ci else None
        else:
            fast, slow, gain = self.rival, self.leader, ratio - 1
            spread = (ci[0] - 1, ci[1] - 1) if ci else None
        interval = f" [{spread[0]:+.1%} to {spread[1]:+.1%}]" if spread else ""
        rounds = f"over {n} paired rounds (noise floor {self.noise:.0%})"
        repeat = self.repeat_interval
        if repeat is not None:  # said from the same side as the gain
            low, high = (
                (1 / repeat[1] - 1, 1 / repeat[0] - 1)
                if fast == self.leader
                else (repeat[0] - 1, repeat[1] - 1)
            )
            rounds += (
                f"; a repeat in fresh processes lands within {low:+.1%} to {high:+.1%} "
                f"({self.between_run_sd:.1%} spread between runs here)"
            )
        if outcome == "tie":
            return (
                f"{fast.label} and {slow.label} tie: {gain:+.1%}{interval}, within the noise floor, {rounds}"
            )
        if outcome == "unresolved":
            return f"{fast.label} vs {slow.label}: {gain:+.1%}{interval}, not resolved {rounds}"
        return f"{fast.label} ran {gain:.1%} faster than {slow.label}{interval} {rounds}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "leader": self.leader.to_dict(),
            "rival": self.rival.to_dict(),
            "ratios": list(self.ratios),
            "noise": self.noise,
            "between_run_sd": self.between_run_sd,
            "outcome": self.outcome,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Duel:
        return cls(
            Candidate.from_dict(data["leader"]),
            Candidate.from_dict(data["rival"]),
            tuple(float(r) for r in data.get("ratios") or ()),
            float(data.get("noise", 0.03)),
            float(data.get("between_run_sd") or 0.0),
        )


@dataclass
class Race:
    """The finalists' duels and the leader at the end."""

    leader: Candidate
    duels: list[Duel] = field(default_factory=list)
    stopped: str | None = None  # why the race ended before every duel was resolved

    def duel(self, a: Candidate, b: Candidate) -> Duel | None:
        """The latest duel between ``a`` and ``b`` (either order)."""
        pair = {a, b}
        return next((d for d in reversed(self.duels) if {d.leader, d.rival} == pair), None)


Measure = Callable[[Candidate, Sequence[Candidate], int], dict[Candidate, tuple[float, ...]]]


def race(
    leader: Candidate,
    rivals: Sequence[Candidate],
    measure: Measure,
    *,
    noise: float,
    budget: Budget,
    cost_s: Callable[[int, int], float],
    between_run_sd: float = 0.0,
) -> Race:
    """Race ``rivals`` against ``leader`` by successive halving. ``measure(leader, rivals, rounds)``
    returns each rival's paired ratios against the leader (a missing rival: it could not be
    measured); ``cost_s(rivals, rounds)`` estimates what a call costs, so no round is started
    that the budget cannot pay."""
    result = Race(leader)
    duels = {r: Duel(leader, r, noise=noise, between_run_sd=between_run_sd) for r in rivals if r != leader}
    rounds = FIRST_ROUNDS
    while duels:
        open_ = [r for r, d in duels.items() if not d.resolved and len(d.ratios) < MAX_ROUNDS]
        if not open_:
            break
        want = min(rounds, MAX_ROUNDS - min(len(duels[r].ratios) for r in open_))
        if not budget.can_pay(cost_s(len(open_), want)):
            result.stopped = budget.why_ended("the budget could not pay for more rounds")
            break
        measured = measure(result.leader, open_, want)
        for rival in open_:
            got = measured.get(rival)
            if not got:  # pruned, failed or stopped: it is out of the race
                gone = duels.pop(rival)
                if gone.ratios:  # stopped after earlier rounds: what they measured stands
                    result.duels.append(gone)
                continue
            duels[rival] = replace(duels[rival], ratios=duels[rival].ratios + got)
        faster = [d for d in duels.values() if d.outcome == "rival faster"]
        if faster:  # a new leader: the others race it (its duel with the old one is resolved)
            best = max(faster, key=lambda d: d.ratio or 0.0)
            result.duels += list(duels.values())
            result.leader = best.rival
            # rivals slower than the old leader are slower than the new one too: out of the race
            duels = {
                r: Duel(result.leader, r, noise=noise, between_run_sd=between_run_sd)
                for r, d in duels.items()
                if r != result.leader and d.outcome != "leader faster"
            }
            rounds = FIRST_ROUNDS
            continue
        rounds *= 2
    result.duels += list(duels.values())
    return result


def paired_rounds(
    framework: Framework,
    workload: Any,
    settings: BenchSettings,
    *,
    isolate: bool,
    events: Events,
    budget: Budget,
    prune_factor: float = 5.0,
) -> Measure:
    """A :data:`Measure` on the real training step: a paired sweep whose reference is the leader."""

    def measure(
        leader: Candidate, rivals: Sequence[Candidate], rounds: int
    ) -> dict[Candidate, tuple[float, ...]]:
        sweep = PairedSweep(
            framework,
            workload,
            replace(settings, steps=rounds, min_time_s=0.0, profile=False, count_flops=False),
            label=framework.workload_label(workload),
            isolate=isolate,
            prune_factor=prune_factor,
            events=events,
            should_stop=budget.expired,
            reference=leader,
        )
        got: dict[Candidate, tuple[float, ...]] = {}
        try:
            sweep.start_baseline(count_flops=False)
            for rival in rivals:
                events(
                    {
                        "event": "stage",
                        "text": f"racing {rival.label} against {leader.label} ({rounds} rounds)",
                    }
                )
                row = sweep.measure(rival)
                if row.status == Status.OK:
                    got[rival] = row.paired_ratios
        except BaselineEnded as ended:  # what was measured counts; the rivals left are out, said
            events({"event": "stage", "text": f"race stopped: {ended.reason}"})
        except SessionEnded:  # told to stop (the budget): what was measured counts
            pass
        finally:
            sweep.close()
        return got

    return measure
