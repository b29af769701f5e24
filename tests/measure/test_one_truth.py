"""One truth (issue 53): a row's speedup and its samples/s say the same thing, or its interval covers
both. A default tune printed bf16-mixed+cl at 2.44x [1.87-2.76] while its own rows read 30.3 vs 14.7
samples/s (2.06x): strict fp32 ran slower beside it than over the whole sweep. Planted rows, no timing."""

from __future__ import annotations

from mixprec.measure.results import BenchRow, assemble
from mixprec.policy import Candidate
from mixprec.tuning.speedups import uncertainty


def _rows(candidate_ms: float, ratios: tuple[float, ...]):
    base = BenchRow("w", Candidate("fp32"), "cpu", 16, "ok", step_times_ms=(1000 * 16 / 14.7,) * 9)
    cand = BenchRow(
        "w",
        Candidate("bf16-mixed", channels_last=True),
        "cpu",
        16,
        "ok",
        step_times_ms=(candidate_ms,) * 9,
        paired_ratios=ratios,
    )
    return {r.label: r for r in assemble([base, cand], None, {})}


def test_a_row_whose_samples_per_s_disagree_with_its_paired_rounds_has_an_interval_covering_both():
    ratios = (2.40, 2.44, 2.47, 2.43, 2.45, 2.44)  # tight: the bootstrap interval alone excludes 2.06
    row = _rows(1000 * 16 / 30.3, ratios)["bf16-mixed+cl"]
    assert row.speedup_vs_fp32 == 2.44
    low, high = row.speedup_ci
    assert low <= 30.3 / 14.7 <= high and high >= 2.44
    assert any("its samples/s say 2.06x" in n and "paired rounds 2.44x" in n for n in row.notes), row.notes
    assert uncertainty(row) > 0.05  # the decision sees how little it knows


def test_a_row_that_agrees_keeps_its_own_interval_and_no_note():
    ratios = (2.03, 2.06, 2.09, 2.05, 2.07, 2.06)
    row = _rows(1000 * 16 / 30.3, ratios)["bf16-mixed+cl"]
    assert row.speedup_ci[1] - row.speedup_ci[0] < 0.07 and row.notes == ()
