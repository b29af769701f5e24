"""The race among finalists on a fake measurement (seeded noise around planted step times): it
resolves a 10% difference, declares a tie only for a difference measured within the noise floor,
hands the lead to a faster rival, and stops at the budget without calling a tie."""

from __future__ import annotations

import math
import random

from mixprec.budget import Budget
from mixprec.measure.race import MAX_ROUNDS, Duel, race
from mixprec.policy import Candidate

A, B, C = Candidate("bf16-mixed"), Candidate("bf16-true"), Candidate("fp32")


def planted(step_s: dict[Candidate, float], jitter: float = 0.03, seed: int = 0):
    """Paired ratios leader/rival around the planted step times, with lognormal noise per round."""
    rng = random.Random(seed)
    calls: list[tuple[Candidate, int, int]] = []

    def measure(leader, rivals, rounds):
        calls.append((leader, len(rivals), rounds))
        return {
            r: tuple(step_s[leader] / step_s[r] * math.exp(rng.gauss(0, jitter)) for _ in range(rounds))
            for r in rivals
        }

    return measure, calls


def run(step_s, leader=A, rivals=(B,), jitter=0.03, budget=None):
    measure, calls = planted(step_s, jitter)
    result = race(
        leader, list(rivals), measure, noise=0.03, budget=budget or Budget(600), cost_s=lambda n, rounds: 0.0
    )
    return result, calls


def test_a_planted_10_percent_difference_is_resolved():
    result, _ = run({A: 1.0, B: 1.0 / 1.10})  # B takes 10% less time per step... as a speedup
    duel = result.duel(A, B)
    assert duel.outcome == "rival faster" and result.leader == B
    assert 1.05 < duel.ratio < 1.15 and len(duel.ratios) <= 8  # resolved in one or two batches of rounds


def test_a_planted_1_percent_difference_is_a_measured_tie():
    result, _ = run({A: 1.0, B: 1.0 / 1.01}, jitter=0.01)
    duel = result.duel(A, B)
    assert duel.outcome == "tie" and result.leader == A
    low, high = duel.interval
    assert low >= 0.97 and high <= 1.03  # the interval lies within the noise floor: that is the tie


def test_a_slower_rival_is_resolved_and_the_leader_stays():
    result, _ = run({A: 1.0, B: 1.2})
    assert result.duel(A, B).outcome == "leader faster" and result.leader == A


def test_a_faster_rival_takes_the_lead_and_the_others_race_it():
    result, calls = run({A: 1.0, B: 0.8, C: 0.9}, rivals=(B, C))
    assert result.leader == B
    assert result.duel(B, C).outcome == "leader faster"  # C was raced against the new leader
    assert [leader for leader, _, _ in calls][-1] == B


def test_only_open_duels_get_more_rounds_and_a_noisy_one_is_never_called_a_tie():
    result, calls = run({A: 1.0, B: 1.0 / 1.015, C: 1.3}, rivals=(B, C), jitter=0.08)
    assert result.duel(A, C).outcome == "leader faster"
    assert calls[0][1] == 2 and all(n == 1 for _, n, _ in calls[1:])  # C settled first
    b = result.duel(A, B)
    assert b.outcome in ("unresolved", "tie", "rival faster") and len(b.ratios) <= MAX_ROUNDS
    if b.outcome == "tie":
        assert b.interval[1] - b.interval[0] <= 0.06


def test_the_budget_ends_the_race_without_a_tie():
    result, calls = run({A: 1.0, B: 1.0 / 1.01}, jitter=0.05, budget=Budget(1, start=0.0))  # long spent
    assert calls == [] and result.stopped and result.duel(A, B).outcome == "unresolved"


def test_a_duel_round_trips_through_json():
    duel = Duel(A, B, (1.1, 1.12, 1.09, 1.11))
    again = Duel.from_dict(duel.to_dict())
    assert again == duel and again.outcome == "rival faster" and "paired rounds" in again.describe()


def test_a_rival_stopped_in_a_later_call_keeps_the_rounds_it_was_measured():
    """The budget stopped the second call of paired rounds partway: the rival's first rounds (and
    the race note and evidence the decision uses) are kept, not thrown away."""
    calls = []

    def measure(leader, rivals, rounds):
        calls.append(rounds)
        if len(calls) > 1:
            return {}  # stopped before this rival was measured again
        return {r: (1.0, 1.2, 0.8, 1.01) for r in rivals}  # too noisy to resolve in one call

    result = race(A, [B], measure, noise=0.03, budget=Budget(600), cost_s=lambda n, rounds: 0.0)
    assert len(calls) == 2
    duel = result.duel(A, B)
    assert duel is not None and duel.ratios == (1.0, 1.2, 0.8, 1.01)


# ResNet-50 (128 px, batch 16) bf16-mixed+cl against its whole step compiled, tune's race duel in
# four fresh process pairs on the 2-core EPYC (benchmarks/results/cpu-amd-epyc/race_pairs-resnet50.json).
RACE_PAIRS = (
    (1.143, 0.934, 0.964, 1.181),
    (1.087, 0.948, 0.928, 1.089),
    (1.043, 1.091, 1.111, 1.167),
    (1.090, 1.108, 1.094, 1.067),
)


def test_a_duels_repeat_interval_covers_the_duel_repeated_in_fresh_processes():
    """One pair's rounds share its processes: their interval excluded other pairs' medians (the
    defect), the repeat interval with the machine's spread between runs takes them in."""
    last = RACE_PAIRS[-1]
    others = [sorted(p)[1:3] for p in RACE_PAIRS[:-1]]
    medians = [(a + b) / 2 for a, b in others]
    rounds_only = Duel(A, B, last)
    low, high = rounds_only.interval
    assert any(not low <= m <= high for m in medians)  # what the race said alone
    assert rounds_only.repeat_interval is None and "repeat" not in rounds_only.describe()
    duel = Duel(A, B, last, between_run_sd=0.032)
    low, high = duel.repeat_interval
    assert all(low <= m <= high for m in medians)
    assert duel.outcome == rounds_only.outcome == "rival faster"  # decided on its rounds, as before
    assert "a repeat in fresh processes lands within -0.7% to +19.6%" in duel.describe()
    assert Duel.from_dict(duel.to_dict()) == duel


def test_a_repeat_interval_is_said_from_the_winners_side():
    duel = Duel(A, B, tuple(1 / r for r in RACE_PAIRS[-1]), between_run_sd=0.032)
    assert duel.outcome == "leader faster"
    assert duel.describe().startswith(f"{A.label} ran ")
    assert "lands within -0.7% to +19.6%" in duel.describe()
