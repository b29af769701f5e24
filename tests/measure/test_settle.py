"""A row's rounds pooled over sessions until its figure is settled (mixprec.measure.settle): how many
more rounds a row needs, and what a pooled row keeps of its first session."""

from __future__ import annotations

import pytest

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
    enough = _row((2.0,) * MIN_ROUNDS, (1.98, 2.02), speedup=2.0, sessions=(4, 4))
    assert rounds_wanted(enough, width=0.05, most=40) == 0


def test_a_narrow_interval_from_one_session_is_not_trusted():
    """bench_vs_tune's run 18 on the EPYC: bench's figure settled over one session of 10 rounds at
    1.85x [1.81-1.92], beside tune's 2.01x over two sessions and plain PyTorch's 2.06x over five
    processes. One session's rounds share its processes' pace, so their interval cannot show an odd
    process: a figure is settled over two sessions at least."""
    one = _row((1.83, 1.92, 1.89, 1.81, 1.77, 2.0, 1.94, 1.83, 1.83, 1.86), (1.81, 1.92), speedup=1.85)
    assert rounds_wanted(one, width=0.05, most=40) == MIN_ROUNDS // 2
    two = _row(one.paired_ratios + (1.85,) * 4, (1.81, 1.92), speedup=1.85, sessions=(10, 4))
    assert rounds_wanted(two, width=0.05, most=40) == 0
    assert rounds_wanted(one, width=0.05, most=12) == 2  # (at most ``most`` in all)


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


# ---------------------------------------------------------------------- each session one vote
def _pooled_in_sweep(first, new):
    """``first`` and ``new`` pooled as settling pools them, its figures assembled as a sweep's are."""
    from mixprec.measure.results import BenchResult

    baseline = BenchRow("w", Candidate("fp32"), "cpu", 8, "ok", step_times_ms=(100.0,) * 4)
    result = BenchResult("w", "", "cpu", 8, {}, measured=[baseline, first])
    result.update(pooled(first, first, new))
    return next(r for r in result.rows if r.candidate == first.candidate)


def _run_14():
    """Tune's pick in run 14 on the AMX Xeon (benchmarks/results/cpu-intel-xeon-amx): its first
    session's 4 rounds and its settling session's 18, pooled."""
    first = _row((2.29, 1.69, 2.38, 2.59), (1.69, 2.59))
    settling = (1.97, 2.36, 1.68, 1.77, 1.79, 1.49, 1.75, 1.77, 1.55)
    settling += (1.72, 1.49, 1.8, 1.94, 1.66, 1.86, 1.67, 2.19, 2.16)
    return _pooled_in_sweep(first, _row(settling, (1.67, 1.94)))


def test_a_long_session_does_not_outvote_the_one_before_it():
    """Run 14 on the AMX Xeon (its rounds, from benchmarks/results/cpu-intel-xeon-amx): tune's pick
    read 2.29, 1.69, 2.38, 2.59 in its first session and 18 rounds between 1.49 and 2.36 in its
    settling one; pooled round by round the figure was that one session's, 1.78x [1.66-1.97], beside
    bench's 2.26x and the probe's 2.20x. Sessions that disagree weigh nearer the same, and the
    interval holds the disagreement."""
    row = _run_14()
    assert row.sessions == (4, 18) and len(row.paired_ratios) == 22
    # (the 22 rounds' median: 1.78; the two sessions' medians 2.34 and 1.78)
    assert 1.95 < row.speedup_vs_fp32 < 2.1
    low, high = row.speedup_ci
    assert low <= 1.78 and high >= 2.34


def test_sessions_that_agree_weigh_by_their_rounds_and_one_session_is_its_median():
    """No session effect (one distribution, 11% per round): the figure and interval are about the
    rounds pooled as one session's; a session of 4 that disagrees with 36 that agree moves it little
    where its own spread explains it."""
    import random
    import statistics

    from mixprec.measure.results import median_ci, session_speedup

    assert session_speedup([3.0, 1.0, 2.0, 4.0]) == (2.5, median_ci([3.0, 1.0, 2.0, 4.0]))
    assert session_speedup([3.0, 1.0, 2.0, 4.0], [4])[0] == 2.5
    rng = random.Random(1)
    same = [2.0 * rng.lognormvariate(0, 0.11) for _ in range(40)]
    figure, (low, high) = session_speedup(same, [4, 18, 18])
    assert figure == pytest.approx(statistics.median(same), rel=0.01)
    one = median_ci(same)
    # (a median's normal interval over 40 rounds: ~4.5% either side; this draw's bootstrap said 2.5%)
    assert (high - low) <= 2 * (one[1] - one[0])
    # the same rounds split 4 + 36, as a tune's first session and its settling one
    figure, (low, high) = session_speedup(same, [4, 36])
    assert figure == pytest.approx(statistics.median(same), rel=0.02) and high / low < 1.2


def test_one_odd_session_among_three_that_agree_is_outvoted_not_averaged_in():
    """A few fresh processes run 10-50% slow (benchmarks/allocator_pace.py): a session whose strict
    fp32 process did reads its ratio that much high. Pooled as a random-effects mean (sessions that
    disagree weigh nearly alike) it moved the figure by a quarter of that over four sessions; their
    median does not move."""
    import random

    from mixprec.measure.results import session_speedup

    rng = random.Random(3)
    odd = [2.6 * rng.lognormvariate(0, 0.03) for _ in range(4)]
    agreeing = [2.0 * rng.lognormvariate(0, 0.03) for _ in range(24)]
    figure, (low, high) = session_speedup(odd + agreeing, [4, 8, 8, 8])
    assert figure == pytest.approx(2.0, rel=0.03)  # (the sessions' mean in log space: 2.14)
    assert low <= 2.0 <= high
    # planted: each session a fresh pair of processes, each slow (10-50%) one time in eight, else
    # within 2.5%; 5% noise a round; truth 1.0. Pooled as a mean, 41% of such figures over four
    # sessions landed more than 5% off (benchmarks/session_outliers.py)
    rng = random.Random(0)

    def process() -> float:
        return rng.uniform(1.1, 1.5) if rng.random() < 0.12 else rng.lognormvariate(0, 0.025)

    off = 0
    for _ in range(300):
        values = []
        for rounds in (4, 8, 8, 8):
            pace = process() / process()
            values += [pace * rng.lognormvariate(0, 0.05) for _ in range(rounds)]
        off += abs(session_speedup(values, [4, 8, 8, 8])[0] - 1) > 0.05
    assert off < 0.25 * 300, off


def test_sessions_that_do_not_add_up_to_the_rounds_are_refused_and_a_stored_one_is_a_corrupt_line():
    from mixprec.measure.results import session_speedup
    from mixprec.measure.rowstore import _well_typed

    with pytest.raises(ValueError, match=r"3 paired ratios do not split into sessions of \[2, 2\]"):
        session_speedup([1.0, 2.0, 3.0], [2, 2])
    good = _row((2.0, 2.1, 1.9), (1.9, 2.1), sessions=(1, 2))
    assert BenchRow.from_dict(good.to_dict()).sessions == (1, 2) and _well_typed(good)
    assert not _well_typed(_row((2.0, 2.1, 1.9), (1.9, 2.1), sessions=(2, 2)))


def test_a_settled_rows_standard_error_is_its_sessions_not_its_rounds():
    """Tune compares a settled pick with its rivals by the standard error of log(speedup): over 22
    rounds of two sessions that disagree, the rounds' own error (~3%) said the figure was known far
    better than its sessions do; it is at least what the sessions' interval says now."""
    import math

    from mixprec.tuning.speedups import Z, log_speed_se

    row = _run_14()
    rounds_only = BenchRow(**{**row.__dict__, "sessions": ()})
    assert log_speed_se(rounds_only) < 0.04
    low, high = row.speedup_ci
    assert log_speed_se(row) == math.log(high / low) / (2 * Z) > 0.08


@pytest.mark.parametrize(
    "values", [[2.0, 1.0], [1.0, 2.0, 4.0], [3.0, 1.0, 2.0, 4.0], [1.1, 0.9, 1.3, 1.0, 1.2, 0.8, 1.05]]
)
def test_the_bootstrap_interval_is_the_percentiles_of_each_resamples_median(values):
    """median_ci counts its resamples at once: each resample's median must be statistics.median's
    of the same draws (the middle value, or the mean of the middle two), its interval their 2.5th and
    97.5th percentiles."""
    import statistics

    import torch

    from mixprec.measure.results import median_ci

    ordered = sorted(values)
    draws = torch.randint(len(values), (2000, len(values)), generator=torch.Generator().manual_seed(0))
    medians = sorted(statistics.median(ordered[i] for i in row) for row in draws.tolist())
    assert median_ci(values) == pytest.approx((medians[int(0.025 * 1999)], medians[int(0.975 * 1999)]))
    assert median_ci(values) == median_ci(list(reversed(values)))  # (the order the rounds came in: none)
