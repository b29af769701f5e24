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
