"""What tune expects a numerics check to cost: the runs the check still needs at their measured
steps, then what checks took on this machine. On planted step times (tests/tuning/scripted.py)."""

from __future__ import annotations

import pytest

from mixprec.budget import Budget
from mixprec.events import ignore
from mixprec.frameworks import register_framework, unregister_framework
from mixprec.hardware.device import detect
from mixprec.measure.race import FIRST_ROUNDS
from mixprec.policy import Candidate
from mixprec.tuning import search as search_module
from mixprec.tuning.config import TuneConfig
from mixprec.tuning.cost import CHECK_STEP_COST
from mixprec.tuning.search import Search, Sweeps

from .scripted import CLOCK, Planted, PlantedFramework, planted_clock  # noqa: F401 (a fixture)

# the busy 2-core EPYC's default tune: strict fp32 2.9-3.4 s a step at 1 thread, bf16-mixed 1.98x
BUSY = {"fp32": 3.4, "bf16-mixed": 1.7}
STEPS = 6

pytestmark = pytest.mark.usefixtures("planted_clock")


class SlowChecks(PlantedFramework):
    """Every training run of a check takes ``run_s`` more on the clock (the speed sweep as planted)."""

    run_s = 0.0

    def trajectory(self, workload, candidate, batches, steps, device, *, perturb=0.0):
        CLOCK.spend(self.run_s)
        return super().trajectory(workload, candidate, batches, steps, device, perturb=perturb)


@pytest.fixture
def framework():
    fw = SlowChecks()
    register_framework(fw)
    yield fw
    unregister_framework("planted")


def swept(framework, seconds, budget_s=300.0):
    config = TuneConfig(budget_s=budget_s, compile_modes=(), lint=False).with_fields(
        steps=4, warmup=1, check_steps=STEPS
    )
    sweeps = Sweeps(
        Planted(seconds, jitter=0.0),
        framework,
        config,
        device="cpu",
        batch_size=8,
        budget=Budget(budget_s, reserve_s=search_module.RESERVE_S),
        events=ignore,
    )
    return Search.start(sweeps, detect("cpu"))


def bf16(policy="bf16-mixed"):
    return Candidate(policy, framework="planted")


def test_the_first_check_is_priced_from_its_runs_at_their_measured_steps(framework):
    """The busy `make demo`: 168 s were left after the speed sweep and the first check was priced
    at 220 s (2x a strict-fp32 step for each of 4 runs of 8 steps), so bf16-mixed (1.98x) was never
    checked and fp32+cl was recommended. Its runs: the fp32 reference, the chaos run and the run a
    bf16 rounding apart at 3.4 s a step, bf16-mixed at 1.7 s, 7 steps each with the probe."""
    search = swept(framework, BUSY)
    first = search.costs.check_s(bf16())
    runs_alone = (STEPS + 1) * (3 * BUSY["fp32"] + BUSY["bf16-mixed"])
    assert runs_alone < first < 168 - search_module.RESERVE_S
    # no lower-precision step measured yet (the late sweep's reserve): priced at strict fp32's
    assert search.costs.check_s() > first


def test_a_later_check_prices_only_its_own_runs(framework):
    search = swept(framework, BUSY)
    first = search.costs.check_s(bf16())
    search.checks.check(bf16())
    pace = search.costs.pace
    # bf16-true: its own run and ranges; the bf16 rounding's fp32 run is made already
    later = search.costs.check_s(bf16("bf16-true")) / pace
    assert later < first / 2.5
    assert later >= CHECK_STEP_COST * (STEPS + 1) * BUSY["fp32"]  # bf16-true unmeasured: fp32's step


def test_checks_that_take_longer_here_price_the_next_one_higher(framework):
    """A busy machine (or hooks that cost more on this model): the next check's price follows what
    the last took against its estimate, so the budget does not start a check it cannot finish."""
    # a planted check's runs cost their planted steps alone: less than the estimate, which prices hooks too
    search = swept(framework, {"fp32": 0.05, "bf16-mixed": 0.025, "bf16-true": 0.025})
    search.checks.check(bf16())
    first = search.costs.pace
    assert first < 1.0
    unpaced = search.costs.check_s(bf16("bf16-true")) / first
    framework.run_s = 3.0 * unpaced  # the next check's one run alone takes 3x its estimate
    search.checks.check(bf16("bf16-true"))
    # the mean of the two checks' paces (the first pays one-time costs: not the last one's alone)
    assert search.costs.pace >= (first + 3.0) / 2 > 1.5
    assert search.costs.check_s(bf16("bf16-true")) >= 1.5 * unpaced


def test_a_check_at_a_micro_batch_is_priced_at_that_micro_batchs_steps(framework):
    """`tune --batch auto`: the check runs at the candidate's micro-batch, strict fp32 included,
    while strict fp32 was measured at another (32 x 2 against bf16-mixed at 64): each run is
    priced per sample of its measured rows, times the samples of a checked step."""
    from dataclasses import replace

    from mixprec.measure.results import BenchRow

    search = swept(framework, BUSY)
    at_64 = replace(bf16(), micro_batch=64, accumulation_steps=1)
    fp32_at_32 = replace(search.framework.baseline, micro_batch=32, accumulation_steps=2)
    # 64 samples a step: bf16-mixed 0.8 s at 64 x 1, strict fp32 1.6 s at 32 x 2 (the batched rows only)
    search.result.measured = [
        BenchRow("planted", fp32_at_32, "cpu", 32, "ok", step_times_ms=(1600.0,) * 5, accumulation_steps=2),
        BenchRow("planted", at_64, "cpu", 64, "ok", step_times_ms=(800.0,) * 5),
    ]
    assert search.costs.step_s(bf16(), 64) == pytest.approx(0.8)
    assert search.costs.step_s(search.framework.baseline, 64) == pytest.approx(1.6)  # 64 samples, not 32
    assert search.costs.step_s(search.framework.baseline, 32) == pytest.approx(0.8)


@pytest.mark.parametrize("budget_s", range(150, 250, 10))
def test_the_speed_sweep_starts_no_candidate_its_share_cannot_finish(framework, budget_s):
    """`make demo` beside two busy processes: its speed sweep started bf16-mixed+cl with 18 s of its
    share left, where a candidate took 32 s, and stopped it part-way 24 s later with no row; the
    check of bf16-mixed then missed its 151 s price by 2 s and tune exited 5 with strict fp32. A
    candidate the share cannot finish, by the quickest measured so far, is not started."""
    seconds = {**BUSY, "bf16-true": 1.6, "fp16-mixed": 3.0, "bf16-mixed+cl": 1.8, "bf16-true+cl": 1.5}
    search = swept(framework, seconds, budget_s=budget_s)
    stopped = search.result.stopped or ""
    assert "while measuring" not in stopped, stopped
    measured = [r for r in search.result.rows if r.status == "ok" and not r.baseline_repeat]
    assert len(measured) >= 2  # strict fp32 and at least one candidate: the share paid for both


# strict fp32 3.4 s a step, every candidate slower (nothing owed a check) and bf16-true slowest: longer
# than the quickest candidate the share judges a start by. Measured in this order.
SLOWER = {"fp32": 3.4, "tf32": 3.6, "fp16-mixed": 3.7, "bf16-mixed": 3.8, "bf16-true": 10.0, "fp16-true": 4.0}
# fp16-mixed 2x strict fp32 first (its check is owed from then on), bf16-mixed slowest and last
OWED = {"fp32": 3.4, "fp16-mixed": 1.6, "tf32": 3.6, "bf32": 3.7, "fp16-true": 4.0, "bf16-true": 3.9}
OWED |= {"fp8-rowwise": 3.8, "fp8-tensorwise": 3.75, "bf16-mixed": 7.0}
FINISHED = " was finished "


def _in_order(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> None:
    """Tune's plan in ``seconds``'s order (tune's own is this machine's predicted format speeds)."""
    order, planned = list(seconds), search_module.tune_plan
    monkeypatch.setattr(
        search_module, "tune_plan", lambda *args: sorted(planned(*args), key=lambda c: order.index(c.label))
    )


def _finished(search: Search) -> str | None:
    """The candidate the speed sweep finished after its share ran out, if any."""
    return next((n.split(FINISHED)[0] for n in search.result.notes if FINISHED in n), None)


def test_a_candidate_under_way_when_the_speed_share_ends_is_finished(framework, monkeypatch):
    """`make demo` beside two busy processes on a Xeon without AVX512-BF16: the share ended 33 s into
    bf16-mixed's 71 s and stopped it, with no row; the late sweep measured it again from its start
    (71 s), then had 56 s left and did not start fp16-mixed (tune exit 5). With nothing measured
    faster than strict fp32, no check needs the time: a candidate under way when the share ends is
    finished, and the share starts nothing after it."""
    _in_order(monkeypatch, SLOWER)
    finished = []
    for budget_s in range(200, 400, 10):
        search = swept(framework, SLOWER, budget_s=budget_s)
        stopped = search.result.stopped or ""
        assert "while measuring" not in stopped, (budget_s, stopped)
        if label := _finished(search):
            timed = [r for r in search.result.measured if r.status == "ok" and not r.baseline_repeat]
            assert timed[-1].label == label, budget_s  # its row, and none measured after it
            assert stopped.startswith("stopped by the deadline before ") or not stopped  # (not "while")
            finished.append(label)
    assert "bf16-true" in finished  # the share ended while it ran, at some of these budgets


def test_a_candidate_is_finished_past_the_share_only_with_time_for_the_check_owed(framework, monkeypatch):
    """fp16-mixed, measured 2x strict fp32 before the share ended, is checked next: a candidate under
    way is finished past the share only where the time after it still pays that check, once what
    settling the pick's figure keeps back is taken (tune takes it before the check)."""
    from mixprec.tuning import settle

    _in_order(monkeypatch, OWED)
    outcomes = set()
    for budget_s in range(400, 640, 20):
        search = swept(framework, OWED, budget_s=budget_s)
        settle.reserve(search)
        if "while measuring" in (search.result.stopped or ""):
            outcomes.add("stopped")
        if label := _finished(search):
            owed = [r.candidate for r in search_module._faster(search.result.rows) if r.label != label]
            # (a step under way when the time is up is finished, and strict fp32 closes the sweep)
            slack = max(OWED.values()) + 2 * OWED["fp32"]
            assert search.budget.left() + slack >= search.costs.check_room(owed, ()), budget_s
            outcomes.add("finished, a check owed" if owed else "finished")
    assert {"stopped", "finished, a check owed"} <= outcomes, outcomes


def test_a_check_that_could_only_win_the_race_waits_for_a_budget_that_pays_the_race_too(framework):
    """`make demo` beside two busy processes (2026-11-30): bf16-mixed+cl (2.19x) passed, then the 45 s
    left went to checking bf16-true (1.76x: slower, within the race window; it failed), and the race of
    bf16-mixed+cl against bf16-mixed had 4 s: not run, and bf16-mixed was picked at 1.73x. A check of
    a candidate slower than a pass is paid only with the race that could pick it."""
    # (planted policies stand for the layouts: bf16-mixed for +cl, fp16-mixed for the eager NCHW twin)
    seconds = {"fp32": 3.4, "bf16-mixed": 1.55, "fp16-mixed": 1.95, "bf16-true": 1.9}
    search = swept(framework, seconds, budget_s=3600)
    for passing in (bf16(), bf16("fp16-mixed")):
        assert search.checks.check(passing).acceptable
    true_row = next(r for r in search.result.rows if r.label == "bf16-true")
    leader = next(r for r in search.result.rows if r.label == "bf16-mixed")
    check_s = search.costs.row_check_s(true_row)
    race_s = search.costs.race_s([leader, true_row])(1, FIRST_ROUNDS)
    # what is left pays bf16-true's check, or the race, not both
    left = max(check_s, race_s) + 0.5 * min(check_s, race_s)
    search.budget.end = CLOCK.now() + search_module.RESERVE_S + left
    search.check_faster()
    assert bf16("bf16-true") not in search.checks.verdicts
    assert any("its check and the race it would need" in n for n in search.notes), search.notes
    search.race_finalists()
    assert search.race is not None and any(d.ratios for d in search.race.duels), search.notes


def test_the_late_sweep_opens_no_strict_fp32_session_it_cannot_measure_a_candidate_beside(framework):
    """`make demo` beside two busy processes (2026-11-30): after bf16-mixed's check, 30 s were left;
    the late sweep opened strict fp32 (about 20 s) and was stopped before its first candidate."""
    search = swept(framework, {**BUSY, "bf16-true": 1.6, "fp16-mixed": 3.0}, budget_s=150)
    assert search.result.stopped  # the share ended before every candidate was measured
    rows, base = len(search.result.rows), search.result.baseline
    assert base is not None and base.wall_s
    search.budget.end = CLOCK.now() + search_module.RESERVE_S + 0.9 * (base.wall_s + search.costs.measure_s())
    before = CLOCK.now()
    search.finish_speed(detect("cpu"))
    assert CLOCK.now() == before and len(search.result.rows) == rows


def test_a_sweep_after_the_first_is_priced_with_the_strict_fp32_session_it_opens(framework):
    """A re-measure was priced at its candidate's rounds alone; started with that much left, it
    spent 23 s opening strict fp32 and replaced nothing (the nanoGPT's tune on the AMX Xeon)."""
    search = swept(framework, BUSY)
    base = search.result.baseline
    assert base is not None and base.wall_s
    opened = base.wall_s  # the first sweep's strict-fp32 session, as timed on the planted clock
    assert search.costs.remeasure_s(bf16()) >= opened + 2 * search.costs.measure_s()
    assert search.costs.variants_s(bf16(), 2) >= opened + 2 * search.costs.sweep_s()


@pytest.mark.parametrize("rounds", [8, 20])
def test_a_sweep_of_more_rounds_is_priced_with_its_longer_strict_fp32_opening(framework, rounds):
    """A sweep's strict-fp32 session times as many steps before its first candidate as the sweep
    has rounds: a re-measure (8) or a settling sweep (up to 36) was priced with the first sweep's
    opening of 4, so one that just fit ran out before its candidate's last round (planted: priced
    18 s, took 21.5 s)."""
    search = swept(framework, {"fp32": 1.0, "bf16-mixed": 0.5})
    cand = bf16()
    row = search.row(cand)
    priced = search.costs.remeasure_s(cand) if rounds == 8 else search.costs.settle_s(row, rounds)
    before = CLOCK.now()
    search.sweeps.sweep([cand], search.budget, steps=rounds)
    assert CLOCK.now() - before <= priced


def test_the_rounds_a_settling_budget_pays_fit_in_it(framework):
    """tune's pick on the AMX Xeon (bench_vs_tune run 11): 'bf16-mixed+cl's figure not settled: its
    sweep measured no row': the rounds bought with the time left did not count the longer
    strict-fp32 opening a sweep of more rounds times."""
    search = swept(framework, {"fp32": 1.0, "bf16-mixed": 0.5})
    cand = bf16()
    row = search.row(cand)
    seconds = search.costs.settle_s(row, 0) + 30.0
    rounds = search.costs.rounds_paid(row, seconds)
    assert rounds > search.sweeps.bench.steps and search.costs.settle_s(row, rounds) <= seconds
    search.budget.end = CLOCK.now() + search.budget.reserve_s + seconds
    swept_rows = search.sweeps.sweep([cand], search.budget, steps=rounds).measured
    assert [len(r.paired_ratios) for r in swept_rows if r.candidate == cand] == [rounds]
