"""The figure tune prints for its pick is one the next run repeats: a sweep's 4 paired rounds left
the same pick at 2.44x in one tune and 1.92x in the next on the EPYC, and on the AMX Xeon at 2.23x
[1.75-3.06] beside bench's 1.70x and a plain probe's 2.01x (issue 53). The pick is measured again
until its interval is narrow; bench does the same when asked (``settle``). On planted step times
with seeded noise (tests/tuning/scripted.py): no clock but the planted one."""

from __future__ import annotations

import random
import statistics
import types

import pytest

import mixprec
from mixprec.budget import Budget
from mixprec.measure.results import BenchRow
from mixprec.measure.settle import SESSION_ROUNDS, rounds_wanted, sessions_of
from mixprec.policy import Candidate
from mixprec.tuning.cost import Costs
from mixprec.tuning.held import Held
from mixprec.tuning.search import SETTLE_SHARE
from mixprec.tuning.settle import reserve

from .scripted import Planted, planted_clock, planted_framework  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("planted_clock", "planted_framework")

# bf16-mixed planted 2x strict fp32's speed, fp16-mixed 1.25x; each step's time is off by 8%
# (lognormal), so one paired round's ratio by about 11% and a median of 4 by about 7%
SPEEDS = {"fp32": 1.0, "bf16-mixed": 0.5, "fp16-mixed": 0.8}


def _tune(seed: int, **fields):
    planted = Planted(SPEEDS, jitter=0.08, rng=random.Random(seed))
    options = dict(budget_s=3600, steps=4, warmup=1, check_steps=2, compile_modes=(), optimizers=False)
    return mixprec.tune(planted, **(options | fields))


def _pick_row(result):
    return next(
        r.row for r in result.ranked if r.row is not None and r.candidate == result.recommendation.candidate
    )


def _half_width(row) -> float:
    low, high = row.speedup_ci
    return max(high - row.speedup_vs_fp32, row.speedup_vs_fp32 - low) / row.speedup_vs_fp32


def test_the_picks_figure_is_measured_over_the_rounds_its_interval_needs():
    result = _tune(0)
    row = _pick_row(result)
    assert row.candidate.policy == "bf16-mixed"
    # 5% asked: the rounds are estimated from the first few (at most 40 in all, two more sweeps); a
    # round is off by ~11% here, so 40 rounds' median by ~4.5%, and the interval holds the sessions'
    # disagreement too (this seed's first 4 rounds read 2.27x beside 2.04x and 1.98x: 7.5%)
    assert len(row.paired_ratios) >= 8 and _half_width(row) <= 0.08, (len(row.paired_ratios), row.speedup_ci)
    assert row.speedup_vs_fp32 == pytest.approx(2.0, rel=0.07)
    note = next(n for n in row.notes if n.startswith("settled over"))
    assert f"settled over {len(row.paired_ratios)} paired rounds" in note and "its first 4 said" in note
    assert any(n.startswith("bf16-mixed settled over") for n in result.notes)
    # the rows the pick was chosen among keep their sweep's rounds: only the pick is settled
    other = next(r.row for r in result.ranked if r.label == "fp16-mixed")
    assert len(other.paired_ratios) == 4


def test_six_tunes_print_their_picks_figure_within_10_percent_of_each_other():
    figures = [_tune(seed).recommendation.speedup_vs_fp32 for seed in range(6)]
    assert max(figures) / min(figures) <= 1.10, figures


def test_a_pick_the_settled_figure_moved_to_is_settled_in_turn():
    """`make demo` and bench_vs_tune run 25 on the AMX Xeon: bf16-mixed, picked within the noise of
    the faster bf16-mixed+cl, was settled (12 and 10 rounds); its narrower interval moved the
    decision to bf16-mixed+cl, recommended on its sweep's 4 rounds with nothing said. Planted:
    fp16-mixed 12% faster than bf16-mixed, each step off by 12%; this seed's sweep has bf16-mixed
    (the safer) within the noise of fp16-mixed."""
    planted = Planted({"fp32": 1.0, "bf16-mixed": 0.56, "fp16-mixed": 0.5}, jitter=0.12, rng=random.Random(0))
    options = dict(budget_s=3600, steps=4, warmup=1, check_steps=2, compile_modes=(), optimizers=False)
    result = mixprec.tune(planted, **options)
    assert any(n.startswith("bf16-mixed settled over") for n in result.notes), result.notes
    row = _pick_row(result)
    assert row.candidate.policy == "fp16-mixed"
    assert len(row.paired_ratios) > 4 and any(n.startswith("settled over") for n in row.notes), row.notes
    assert any("bf16-mixed's settled figure moved the decision to fp16-mixed" in n for n in result.notes)


def test_settle_zero_keeps_the_sweeps_figure():
    row = _pick_row(_tune(0, settle=0.0))
    assert len(row.paired_ratios) == 4 and not any(n.startswith("settled") for n in row.notes)


def test_bench_settles_every_row_when_asked_and_stops_at_its_round_cap():
    planted = Planted(SPEEDS, jitter=0.08, rng=random.Random(4))
    settled = mixprec.bench(planted, steps=4, warmup=1, settle=0.05, isolate=False)
    for row in settled.rows:
        if row.paired_ratios:
            # settled, or stopped at the 40 rounds the default caps it to (its sessions' spread
            # widens the interval: fp16-mixed's five sessions here reach 5.2%)
            settled_or_capped = _half_width(row) <= 0.05 or len(row.paired_ratios) == 40
            assert len(row.paired_ratios) > 4 and settled_or_capped, (row.label, row.speedup_ci)
            assert statistics.median(row.paired_ratios) == pytest.approx(
                SPEEDS["fp32"] / SPEEDS[row.policy], rel=0.05
            )
    noisy = Planted(SPEEDS, jitter=0.5, rng=random.Random(5))  # no 7 rounds can settle 50% noise
    capped = mixprec.bench(noisy, steps=4, warmup=1, settle=0.05, settle_rounds=7, isolate=False)
    assert {len(r.paired_ratios) for r in capped.rows if r.paired_ratios} == {7}


def _search_for_reserve(settle_s, spread=0.1):
    """What :func:`mixprec.tuning.settle.reserve` reads of a tune after its speed sweep: one row
    at 2x over 4 rounds, ``spread`` either side (10%: it wants 12 more rounds; 4%: the 4 more that
    make the fewest a figure is settled over), a 300 s budget; each settling session priced by
    ``settle_s``."""
    row = BenchRow(
        "w",
        Candidate("bf16-mixed"),
        "cpu",
        8,
        "ok",
        paired_ratios=(1.9, 2.0, 2.0, 2.1),
        speedup_vs_fp32=2.0,
        speedup_ci=(2.0 * (1 - spread), 2.0 * (1 + spread)),
    )
    setting = types.SimpleNamespace(
        config=types.SimpleNamespace(settle=0.05), bench=types.SimpleNamespace(settle_rounds=40, steps=4)
    )
    costs = Costs(types.SimpleNamespace(rows=[row]), setting, {})
    costs.settle_s = settle_s  # (the price of one settling session, planted)
    budget = Budget(300.0)
    return types.SimpleNamespace(
        result=types.SimpleNamespace(rows=[row]),
        sweeps=setting,
        budget=budget,
        costs=costs,
        held=Held(budget),
    )


def test_the_time_to_settle_the_pick_is_kept_back_only_where_its_share_pays_a_session():
    # 12 rounds: two sessions of 6 (a fresh process's pace is its own), each paying its opening
    cheap = _search_for_reserve(lambda row, rounds: 10.0 + 2.0 * rounds)  # 2 x 22 s
    assert reserve(cheap) == 44.0 and cheap.budget.reserve_s == 44.0
    dear = _search_for_reserve(lambda row, rounds: 10.0 + 7.0 * rounds)  # 2 x 52 s, capped
    assert reserve(dear) == SETTLE_SHARE * 300 and dear.budget.reserve_s == SETTLE_SHARE * 300
    # a busy machine: strict fp32's opening and 4 rounds cost more than the 75 s share would keep,
    # so nothing is kept back to go unused (`make demo` beside two busy loops ended 50 s early)
    busy = _search_for_reserve(lambda row, rounds: 70.0 + 3.0 * rounds)  # 4 rounds: 82 s
    assert reserve(busy) == 0.0 and busy.budget.reserve_s == 0.0


def test_the_time_kept_to_settle_the_pick_pays_a_session_that_breaks_a_tie():
    """bench_vs_tune's run 17 on the EPYC: the pick's sweep said 2.02x [1.98-2.12] over 4 rounds, so
    4 more were wanted and one session's time was kept; that session read 1.40-1.64x (one of a few
    fresh processes that run 10-50% slow), the figure printed was 1.78x between the two, and the
    budget paid no third session to outvote the odd one. The time kept pays it."""
    per_session = lambda row, rounds: 10.0 + 2.0 * rounds  # noqa: E731
    narrow = _search_for_reserve(per_session, spread=0.04)
    assert rounds_wanted(narrow.result.rows[0], 0.05, 40) == 4  # (the fewest a figure is settled over)
    assert reserve(narrow) == 2 * per_session(None, 4), "one session of 4 rounds and one to break a tie"
    assert narrow.held.tiebreak_s == per_session(None, 4)  # (a compile that may beat the pick takes it first)


def test_the_rounds_a_figure_wants_go_to_at_least_three_sessions_where_they_allow():
    """The same 12 rounds as the sweep's 4 and one session of 8 are more than 5% off in 41% of
    planted figures with 12% of processes slow, as three sessions of 4 in 23%
    (benchmarks/session_outliers.py): a median of three outvotes an odd one, a mean of two cannot."""
    assert sessions_of(8) == [8]  # (bench's default: the fewest sessions)
    assert sessions_of(8, fewest=2, least=4) == [4, 4]
    assert sessions_of(6, fewest=2, least=4) == [6]  # (a session of 3 would not pay its opening)
    assert sessions_of(12, fewest=2, least=4) == [6, 6]
    assert sessions_of(20, fewest=2, least=4) == [7, 7, 6]
    assert sessions_of(4, fewest=2, least=4) == [4] and sessions_of(0, fewest=2) == []


def test_a_settling_session_leaves_rounds_for_a_third(planted_framework, monkeypatch):  # noqa: F811
    """A pick over its sweep's one session that wants 8 more rounds measures 4 of them in the next
    session, so that a third session can outvote one of the two where they disagree (4+8: the mean
    of two, where one is odd, moves the figure halfway)."""
    from dataclasses import replace

    from mixprec.tuning import settle as settle_module

    from .test_check_pricing import swept

    search = swept(planted_framework, {"fp32": 1.0, "bf16-mixed": 0.5}, budget_s=3600)
    pick = search.row(Candidate("bf16-mixed", framework="planted"))
    wide = (1.83, 2.17, 1.9, 2.1)  # 8.5% either side over 4 rounds: 8 more wanted
    search.result.update(replace(pick, paired_ratios=wide))
    assert rounds_wanted(search.row(pick.candidate), 0.05, 40) == 8
    asked = []
    real = search.sweeps.sweep

    def counted(candidates, budget, steps=None, **kw):
        asked.append(steps)
        return real(candidates, budget, steps, **kw)

    monkeypatch.setattr(search.sweeps, "sweep", counted)
    assert settle_module.settle(search, types.SimpleNamespace(candidate=pick.candidate))
    # (the planted steps have no noise: the two sessions agree, and the interval the 8 rounds give
    # leaves nothing for a third to settle)
    assert asked == [4] and search.row(pick.candidate).sessions == (4, 4), (asked, search.notes)


def test_time_kept_to_settle_the_pick_goes_to_a_noisy_rival_first(planted_clock, planted_framework):  # noqa: F811
    """bench_vs_tune's run 9 on the AMX Xeon: the time kept back to settle the pick left
    bf16-mixed+cl (1.91x, its interval 33% either side) not re-measured, and bf16-mixed (1.58x) was
    picked and settled. A rival that may beat the pick is measured again before the pick's figure
    is settled, with the time kept for that if need be."""
    from dataclasses import replace

    from .test_check_pricing import swept

    search = swept(planted_framework, {"fp32": 1.0, "fp32+cl": 0.5, "bf16-mixed": 0.5})
    rival = search.row(Candidate("bf16-mixed", framework="planted"))
    noisy = (1.3, 3.2, 1.6, 3.0)  # its median 2.3x, its interval far wider than NOISE_CAP
    search.result.update(replace(rival, paired_ratios=noisy, speedup_vs_fp32=2.3, speedup_ci=(1.3, 3.2)))
    search.check_faster()
    rec = search.decide()[0]
    assert rival.candidate in rec.remeasure, rec.remeasure
    assert reserve(search) > 0
    cost = search.costs.remeasure_s(rival.candidate)
    # what is left pays the re-measure only with the time kept back for settling
    search.budget.end = planted_clock.now() + search.budget.reserve_s - search.held.seconds + cost + 1.0
    assert not search.budget.can_pay(cost), (cost, search.held.seconds)
    search.remeasure_noisy()
    row = search.row(rival.candidate)
    assert row.paired_ratios != noisy and any("re-measured" in n for n in row.notes), search.notes
    assert search.held.seconds == 0.0 and not search.budget.cuts


def test_a_settling_sweep_the_budget_stopped_says_so_and_keeps_the_first_figure(
    planted_framework,  # noqa: F811
    monkeypatch,
):
    """A 150 s tune of a script said "fp32 (as written)'s figure not settled: its sweep measured no
    row" beside a table holding that row: the settling sweep had been stopped by the budget, and
    the note said neither that nor which figure stands."""
    from dataclasses import replace

    from mixprec.tuning import settle as settle_module

    from .test_check_pricing import swept

    search = swept(planted_framework, {"fp32": 1.0, "bf16-mixed": 0.5})
    pick = search.row(Candidate("bf16-mixed", framework="planted"))
    noisy = (1.5, 2.6, 1.7, 2.5)  # an interval wide enough to want more rounds
    search.result.update(replace(pick, paired_ratios=noisy, speedup_vs_fp32=2.1, speedup_ci=(1.5, 2.6)))
    rec = types.SimpleNamespace(candidate=pick.candidate)
    stopped = "stopped by the deadline before bf16-mixed"

    def cut(candidates, budget, steps=None, **_):
        return replace(search.result, measured=[], stopped=stopped)

    monkeypatch.setattr(search.sweeps, "sweep", cut)
    assert settle_module.settle(search, rec) is False
    note = next(n for n in search.notes if "not settled" in n)
    assert f"no new row ({stopped}); the figure is the first sweep's" in note, note
    assert search.row(pick.candidate).paired_ratios == noisy


def test_settling_rounds_go_to_fresh_sessions_whose_pace_is_their_own(planted_framework, monkeypatch):  # noqa: F811
    """Issue 53 on the AMX Xeon: a fresh process keeps a pace of its own (fresh processes of 8
    rounds each spread 7.7%, 4.1% of it their rounds' noise), while one process held within 2% for
    12 minutes (benchmarks/speedup_drift.py). bench settled 30 rounds in one session there: rounds
    that average one process's pace. Planted: each session's pace 4.5% off the machine's."""
    monkeypatch.setattr(type(planted_framework), "_labels", set(SPEEDS))  # (bench plans no tune)
    figures = []
    for seed in range(16):
        planted = Planted(SPEEDS, jitter=0.08, session_sd=0.045, rng=random.Random(seed))
        result = mixprec.bench(
            planted, policies=("fp32", "bf16-mixed"), steps=4, warmup=1, settle=0.05, isolate=False
        )
        row = next(r for r in result.rows if r.label == "bf16-mixed")
        assert len(row.sessions) >= 3 and max(row.sessions) <= SESSION_ROUNDS, row.sessions
        figures.append(row.speedup_vs_fp32)
    # sixteen benches' figures: 3.6% apart (sd); with each settling session as long as the rounds
    # wanted (two at most), 5.3%
    assert statistics.stdev(figures) / statistics.mean(figures) <= 0.045, figures


def test_the_time_kept_to_break_a_tie_goes_to_a_race_that_may_change_the_pick(
    planted_clock,  # noqa: F811
    planted_framework,  # noqa: F811
):
    """bench_vs_tune's run 20 on the EPYC: the time kept back for a third settling session left no
    race of bf16-mixed against bf16-mixed+cl (9.6% faster, within the noise of their sweep): "the
    budget could not pay for more rounds", and bf16-mixed was picked as the simpler. Which candidate
    is picked comes before how closely its figure is known: the race takes that time first."""
    from mixprec.measure.race import FIRST_ROUNDS
    from mixprec.tuning.search import _finalists

    from .test_check_pricing import swept

    search = swept(planted_framework, {"fp32": 1.0, "bf16-mixed": 0.5, "bf16-true": 0.46}, budget_s=3600)
    search.check_faster()
    finalists = _finalists(search.decide()[1], search.result.baseline, search.sweeps.config.train_steps)
    assert len(finalists) == 2, finalists
    cost = search.costs.race_s(finalists)(1, FIRST_ROUNDS)
    tiebreak = cost  # (kept back as reserve() keeps it)
    search.held.keep(tiebreak, tiebreak)
    # what is left pays the race's first rounds only with the tie-break's time
    search.budget.end = planted_clock.now() + search.budget.reserve_s + cost - tiebreak / 2
    assert not search.budget.can_pay(cost)
    search.race_finalists()
    assert search.race is not None and not search.race.stopped, search.notes
    assert search.race.duels and all(d.ratios for d in search.race.duels), search.notes
    assert search.held.tiebreak_s == 0.0 and search.held.seconds == 0.0


def test_the_time_kept_to_break_a_tie_goes_to_the_optimizers_implementations(
    planted_clock,  # noqa: F811
    planted_framework,  # noqa: F811
    monkeypatch,
):
    """bench_vs_tune's run 20 on the EPYC ended with "the optimizer's implementations of bf16-mixed
    not measured: budget spent" while time was kept back for a third settling session. A faster
    implementation would be the pick: it takes the tie-break's part first, as the race does."""
    from dataclasses import replace

    from .test_check_pricing import swept

    search = swept(
        planted_framework, {"fp32": 1.0, "bf16-mixed": 0.5, "bf16-mixed+fused": 0.4}, budget_s=3600
    )
    search.check_faster()
    rec = search.decide()[0]
    assert rec is not None and rec.candidate.policy == "bf16-mixed"
    monkeypatch.setattr(planted_framework, "optimizer_impls", ("fused",))
    monkeypatch.setattr(
        planted_framework, "optimizer_variants", lambda workload, c: [replace(c, optimizer="fused")]
    )
    cost = search.costs.variants_s(rec.candidate, 1)
    search.held.keep(cost, cost)
    # what is left pays the variant's sweep only with the tie-break's time
    search.budget.end = planted_clock.now() + search.budget.reserve_s + cost / 2
    assert not search.budget.can_pay(cost)
    search.try_optimizers(rec)
    assert not any("implementations" in n for n in search.notes), search.notes
    fused = search.row(replace(rec.candidate, optimizer="fused"))
    assert fused is not None and fused.status == "ok", search.notes
    assert search.held.tiebreak_s == 0.0


def test_a_check_with_no_pass_yet_takes_all_the_time_kept_to_settle():
    """`make demo` beside two busy loops (2026-12-04): 75 s kept back to settle a pick left
    bf16-mixed (1.89x) unchecked for want of 107 s; with no pass there was no pick to settle, and
    tune ended at 193 s of 300 with strict fp32. A check with no pass yet may take all of it; other
    work that may change the pick, the tie-break's part only."""
    budget = Budget(300.0, reserve_s=10.0)
    budget.end = budget.start + 300.0
    held = Held(budget)
    held.keep(75.0, 35.0)
    left = budget.left()
    assert not held.tiebreak_for(left + 60.0, budget)  # (the tie-break's 35 s do not pay 60 more)
    assert held.seconds == 75.0 and held.tiebreak_s == 35.0
    assert held.all_for(left + 60.0, budget)
    assert held.seconds == 0.0 and held.tiebreak_s == 0.0 and budget.reserve_s == 10.0


def test_time_kept_to_settle_a_row_that_needs_none_now_goes_to_the_optimizers_implementations(
    planted_clock,  # noqa: F811
    planted_framework,  # noqa: F811
    monkeypatch,
):
    """bench_vs_tune's run 32 on the EPYC: the time kept back after the speed sweep to settle its
    fastest row (bf16-true+cl, which then failed its check) stayed kept while the pick, bf16-mixed+cl,
    was settled by this machine's record of it: its optimizer's implementations were "budget spent"
    and tune ended at 193 s of its 300. What settling the pick as it stands no longer needs is given
    back to work that may change the pick."""
    from dataclasses import replace

    from .test_check_pricing import swept

    search = swept(
        planted_framework, {"fp32": 1.0, "bf16-mixed": 0.5, "bf16-mixed+fused": 0.4}, budget_s=3600
    )
    reserve(search)  # kept for bf16-mixed's figure: 4 rounds want more
    kept = search.held.seconds
    assert kept > search.held.tiebreak_s > 0
    search.check_faster()
    rec = search.decide()[0]
    assert rec is not None and rec.candidate.policy == "bf16-mixed"
    row = search.row(rec.candidate)
    search.result.update(replace(row, earlier=((2.0,) * 8,) * 6))  # the record settles it
    monkeypatch.setattr(planted_framework, "optimizer_impls", ("fused",))
    monkeypatch.setattr(
        planted_framework, "optimizer_variants", lambda workload, c: [replace(c, optimizer="fused")]
    )
    cost = search.costs.variants_s(rec.candidate, 1)
    # what is left pays the variant's sweep only with the time kept to settle, not with its tie-break part
    search.budget.end = (
        planted_clock.now() + search.budget.reserve_s + cost - (kept + search.held.tiebreak_s) / 2
    )
    assert not search.budget.can_pay(cost)
    search.try_optimizers(rec)
    assert not any("implementations" in n for n in search.notes), search.notes
    fused = search.row(replace(rec.candidate, optimizer="fused"))
    assert fused is not None and fused.status == "ok", (search.notes, fused.reason)
    assert search.held.seconds == 0.0


def test_a_check_of_a_candidate_faster_than_the_pass_takes_all_the_time_kept_to_settle(
    planted_clock,  # noqa: F811
    planted_framework,  # noqa: F811
):
    """probe_vs_tune on the EPYC (nanoGPT, 2026-12-04): bf16-true passed at 2.04x, then
    bf16-true+compile-step measured 2.38x and went unchecked ("the budget could not pay the about
    35 s its check would take") while the time kept back settled bf16-true's figure: the pick was
    88.6% of the plain probe's best. A check that may replace the pick comes before settling the
    figure it would replace: it may take all of that time, not only the tie-break's part."""
    from .test_check_pricing import swept

    search = swept(planted_framework, {"fp32": 1.0, "bf16-mixed": 0.5, "bf16-true": 0.4}, budget_s=3600)
    passed = search.row(Candidate("bf16-mixed", framework="planted"))
    search.checks.check(passed.candidate.numerics)  # the pass so far
    faster = Candidate("bf16-true", framework="planted")
    row = search.row(faster)
    cost = search.costs.row_check_s(row) + search.costs.race_to_win_s(row, passed)  # (as it is priced)
    search.held.keep(cost, cost / 4)
    # what is left pays the check only with all the time kept back, not with the tie-break's part
    search.budget.end = planted_clock.now() + search.budget.reserve_s - search.held.seconds + cost + 1.0
    assert not search.budget.can_pay(cost) and cost > 2.0  # (so the tie-break's quarter cannot pay it)
    search.check_faster()
    assert faster.numerics in search.checks.verdicts, search.notes
    assert search.decide()[0].candidate == faster
    assert search.held.seconds == 0.0
