"""A row's rounds pooled over sessions until its figure is settled (mixprec.measure.settle): how many
more rounds a row needs, and what a pooled row keeps of its first session."""

from __future__ import annotations

from mixprec.measure.results import BenchRow
from mixprec.measure.settle import MIN_ROUNDS, pooled, rounds_wanted
from mixprec.policy import Candidate


def _row(ratios, ci, status="ok", **fields):
    median = sorted(ratios)[len(ratios) // 2] if ratios else None
    return BenchRow(
        "w",
        Candidate("bf16-mixed"),
        "cpu",
        8,
        status,
        paired_ratios=tuple(ratios),
        speedup_vs_fp32=fields.pop("speedup", median),
        speedup_ci=ci,
        **fields,
    )


def test_a_wide_row_wants_the_rounds_that_narrow_its_interval_as_one_over_sqrt_n():
    # 4 rounds, an interval 10% either side of 2.0: 5% needs 4 x (10/5)^2 = 16 rounds, 12 more
    row = _row((1.9, 2.0, 2.0, 2.1), (1.8, 2.2), speedup=2.0)
    assert rounds_wanted(row, width=0.05, most=40) == 12
    # 30% either side would need 144: capped at 40 in all
    assert rounds_wanted(_row((1.9, 2.0, 2.0, 2.1), (1.4, 2.6), speedup=2.0), width=0.05, most=40) == 36


def test_a_narrow_interval_over_few_rounds_is_not_trusted():
    few = _row((2.0, 2.01, 2.02, 2.03), (2.0, 2.03), speedup=2.01)  # 4 rounds, 1% either side
    assert rounds_wanted(few, width=0.05, most=40) == MIN_ROUNDS - 4
    enough = _row((2.0,) * MIN_ROUNDS, (1.98, 2.02), speedup=2.0)
    assert rounds_wanted(enough, width=0.05, most=40) == 0


def test_rows_that_did_not_measure_or_have_their_rounds_want_none():
    assert rounds_wanted(_row((0.3, 0.3), (0.1, 0.5), status="pruned"), width=0.05, most=40) == 0
    assert rounds_wanted(_row((), None), width=0.05, most=40) == 0
    full = _row((2.0,) * 40, (1.0, 3.0), speedup=2.0)
    assert rounds_wanted(full, width=0.05, most=40) == 0


def test_a_pooled_row_keeps_every_round_and_its_first_sessions_compile_and_notes():
    first = _row((2.0, 2.2), (1.9, 2.3), step_times_ms=(10.0, 11.0), first_step_ms=9000.0, wall_s=30.0)
    first = BenchRow(**{**first.__dict__, "notes": ("pruned on the first attempt",)})
    new = _row((1.8, 1.9, 2.0), (1.7, 2.1), step_times_ms=(12.0, 12.0, 13.0), first_step_ms=400.0, wall_s=8.0)
    row = pooled(first, first, new)
    assert row.paired_ratios == (2.0, 2.2, 1.8, 1.9, 2.0)
    assert row.step_times_ms == (10.0, 11.0, 12.0, 12.0, 13.0)
    assert row.first_step_ms == 9000.0 and row.wall_s == 38.0
    assert row.notes == ("pruned on the first attempt",)
