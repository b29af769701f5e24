"""The tune decision on synthetic measurements, and tune/autotune end to end on the tiny mlp."""

from __future__ import annotations

import json
import time
import types
from dataclasses import replace

import pytest
import torch

import mixprec
from mixprec.cli import main
from mixprec.measure.config import BenchConfig
from mixprec.measure.results import BenchRow, assemble
from mixprec.numerics.results import CandidateCheck
from mixprec.policy import Candidate
from mixprec.tuning import autotune, decide, tune
from mixprec.tuning.config import TuneConfig
from sweep_cuts import cut_at_candidate


def step_times(median: float, iqr: float, n: int = 11) -> tuple[float, ...]:
    """``n`` (odd) evenly spaced step times with this median and inter-quartile range."""
    half = (n - 1) // 2
    # exclusive quartiles of n evenly spaced points sit (n+1)/4 points from each end
    spread = iqr / (2 * (half - (n + 1) / 4 + 1)) if n > 3 else 0.0
    return tuple(median + spread * (i - half) for i in range(n))


def row(policy, thr, *, cl=False, status="ok", keep=(), iqr=0.5, mem=1000, n=11):
    step = 1000.0 * 8 / thr if thr else None
    return BenchRow(
        "w",
        Candidate(policy, cl, tuple(keep)),
        "cpu",
        8,
        status,
        step_times_ms=step_times(step, iqr * step / 100, n) if step else (),
        peak_memory_bytes=mem,
    )


def rows(*items):
    """The rows as a sweep reports them: with speedups against the fp32 row."""
    return assemble(items, None, {})


def verdict(policy, ok=True, reason="matches fp32", keep=()):
    return CandidateCheck(
        Candidate(policy, keep_fp32=tuple(keep)),
        "pass" if ok else "fail",
        reason,
        max_rel_loss_diff=0.001,
        output_sqnr_db=40.0,
        min_grad_sqnr_db=30.0,
        fix_verified=bool(keep),
    )


def verdicts(*checks):
    return {c.candidate: c for c in checks}


def test_fastest_passing_candidate_wins():
    measured = rows(
        row("fp32", 100), row("bf32", 130), row("bf16-mixed", 250), row("bf16-mixed", 240, cl=True)
    )
    rec, table = decide(measured, verdicts(verdict("bf16-mixed"), verdict("bf32")))
    assert rec.label == "bf16-mixed" and rec.speedup_vs_fp32 == pytest.approx(2.5)
    assert {c.label: c.status for c in table}["bf32"] == "pass"
    assert "bf16-mixed is 2.50x faster than strict fp32" in rec.reason


def test_failing_fast_candidate_is_rejected_with_its_reason():
    measured = rows(row("fp32", 100), row("fp16-mixed", 300), row("bf16-mixed", 250))
    checks = verdicts(
        verdict("fp16-mixed", ok=False, reason="loss became non-finite at step 0"), verdict("bf16-mixed")
    )
    rec, table = decide(measured, checks)
    assert rec.candidate.policy == "bf16-mixed"
    status = {c.label: (c.status, c.reason) for c in table}
    assert status["fp16-mixed"] == ("fail", "loss became non-finite at step 0")
    assert "fp16-mixed rejected: loss became non-finite" in rec.reason


def test_tie_within_noise_goes_to_the_safer_candidate_and_says_so():
    measured = rows(row("fp32", 100), row("bf16-mixed", 250), row("bf16-true", 255))
    checks = verdicts(verdict("bf16-mixed"), verdict("bf16-true"))
    rec, _ = decide(measured, checks, noise=0.03)
    assert rec.candidate.policy == "bf16-mixed"  # fp32 master weights beat pure bf16 within 2% noise
    assert rec.tie_break and "within measurement noise" in rec.tie_break
    assert rec.tied_with == Candidate("bf16-true")  # what tune re-measures when budget is left
    # outside the noise band the faster one wins
    rec, _ = decide(rows(row("fp32", 100), row("bf16-mixed", 250), row("bf16-true", 300)), checks, noise=0.03)
    assert rec.candidate.policy == "bf16-true" and rec.tie_break is None


def test_wide_iqr_widens_the_noise_band():
    # 7% apart; step-time IQR 30% of the median over 10 steps: the medians' standard errors
    # (0.93 * 0.30 / sqrt(10) = 8.8% each, 12.5% combined) make it a tie, so NCHW (simpler) wins
    measured = rows(row("fp32", 100), row("bf16-mixed", 250, iqr=30), row("bf16-mixed", 270, cl=True, iqr=30))
    rec, _ = decide(measured, verdicts(verdict("bf16-mixed")), noise=0.03)
    assert rec.label == "bf16-mixed"
    # the same spread is not a tie when it is the median of many more steps
    measured = rows(
        row("fp32", 100, n=201),
        row("bf16-mixed", 250, iqr=30, n=201),
        row("bf16-mixed", 270, cl=True, iqr=30, n=201),
    )
    rec, _ = decide(measured, verdicts(verdict("bf16-mixed")), noise=0.03)
    assert rec.label == "bf16-mixed+cl"


def test_rescued_candidate_competes_at_its_measured_cost():
    measured = rows(
        row("fp32", 100),
        row("fp16-mixed", 300),
        row("fp16-mixed", 280, keep=("head",)),
        row("bf16-mixed", 200),
    )
    checks = verdicts(
        verdict("fp16-mixed", ok=False, reason="overflow"),
        verdict("fp16-mixed", keep=("head",)),
        verdict("bf16-mixed"),
    )
    rec, _ = decide(measured, checks)
    assert rec.label == "fp16-mixed+fp32[head]" and rec.candidate.keep_fp32 == ("head",)
    assert rec.speedup_vs_fp32 == pytest.approx(2.8)  # the rescue's own cost, not the failing row's
    assert "head kept in fp32" in rec.reason
    assert rec.config("cpu").keep_fp32 == ("head",)


def test_unchecked_and_slower_candidates_are_not_recommended():
    measured = rows(
        row("fp32", 100),
        row("bf32", 90),
        row("bf16-mixed", 400),
        row("fp16-mixed", None, status="pruned"),
    )
    rec, table = decide(measured, {})
    assert rec.candidate.policy == "fp32"
    status = {c.label: c.status for c in table}
    assert status == {
        "fp32": "recommended",
        "bf32": "slower",
        "bf16-mixed": "unchecked",
        "fp16-mixed": "pruned",
    }
    assert "stay in fp32" in rec.reason


def test_compile_time_is_amortised_over_the_training_run():
    """A compiled bf16 step 3.0x faster than fp32 after 60 s of compilation beats eager bf16 at 2.5x
    over a long run, but not over 100 steps: 100 fp32 steps of 80 ms take 8 s, so the compiled
    run takes 60 + 8/3 s (0.13x) while eager takes 8/2.5 s."""
    from dataclasses import replace

    base, eager, compiled = row("fp32", 100), row("bf16-mixed", 250), row("bf16-mixed", 300)
    compiled = replace(
        compiled,
        candidate=replace(compiled.candidate, compile="default"),
        first_step_ms=60_000 + compiled.step_time_ms.median_ms,
    )
    measured = rows(base, eager, compiled)
    compiled_check = replace(verdict("bf16-mixed"), candidate=compiled.candidate.numerics)
    checks = verdicts(verdict("bf16-mixed"), compiled_check)
    long_run, _ = decide(measured, checks, train_steps=100_000)
    assert long_run.candidate.compile == "default"
    assert "over 100000 steps after 60 s of compilation" in long_run.reason
    short_run, _ = decide(measured, checks, train_steps=100)
    assert short_run.label == "bf16-mixed" and short_run.candidate.compile is None


def test_memory_saved_and_tf32_speedup():
    measured = rows(row("fp32", 100, mem=5000), row("tf32", 200, mem=5000), row("bf16-mixed", 400, mem=3000))
    rec, _ = decide(measured, verdicts(verdict("bf16-mixed"), verdict("tf32")))
    assert rec.memory_saved_bytes == 2000 and rec.speedup_vs_tf32 == pytest.approx(2.0)


# What the decision documents (README, "A speedup's interval is where a repeat run lands"; decide.py),
# written out from that text and the rows' own figures for the end-to-end test below, so a wrong
# pick fails it whatever the decision code computes: each passing row's interval is its paired 95%
# interval, never narrower than +-noise/2 around its speedup (strict fp32, the reference, is 1.0
# exactly); a compiled row's, times its speedup over a run of train_steps steps with its compile paid
# once over its per-step speedup. The pick passed; it never lies entirely below a passing row's
# interval, nor loses a duel the race resolved; a passing row measured faster than it, within noise,
# is a tie the recommendation names (or a noisy row it sets aside for a re-measure).
NOISE, TRAIN_STEPS = 0.03, 10_000  # TuneConfig's defaults


def hand_interval(row: BenchRow, base: BenchRow) -> tuple[float, float, float]:
    """(low, speedup, high): over the whole run for a compiled row."""
    if row.candidate == base.candidate:
        return 1 - NOISE / 2, 1.0, 1 + NOISE / 2
    s = row.speedup_vs_fp32
    assert s and row.speedup_ci is not None, row  # every candidate tune measures is paired
    lo, hi = min(row.speedup_ci[0], s, s * (1 - NOISE / 2)), max(row.speedup_ci[1], s, s * (1 + NOISE / 2))
    scale = 1.0
    if row.candidate.compile and row.compile_s is not None and base.step_time_ms is not None:
        run_s = TRAIN_STEPS * base.step_time_ms.median_ms / 1e3  # strict fp32's run
        scale = run_s / (row.compile_s + run_s / s) / s
    return lo * scale, s * scale, hi * scale


def assert_the_pick_stands(rec, ranked, base: BenchRow, race=None) -> None:
    chosen = next(c for c in ranked if c.candidate == rec.candidate)
    assert chosen.verdict == "pass", (chosen.label, chosen.verdict)
    passing = [
        c
        for c in ranked
        if c.row is not None
        and c.row.status == "ok"
        and (c.verdict == "pass" or c.candidate == base.candidate)
    ]
    pick = hand_interval(chosen.row, base)
    for other in passing:
        if other.candidate == chosen.candidate:
            continue
        duel = race.duel(other.candidate, chosen.candidate) if race is not None else None
        if duel is not None and duel.resolved:
            assert duel.faster() != other.candidate, (rec.label, duel.describe())
            continue
        theirs = hand_interval(other.row, base)
        assert theirs[0] <= pick[2], f"{rec.label} {pick} lies below {other.label} {theirs}: {rec.reason}"
        if theirs[1] > pick[1]:  # measured faster, within noise: the recommendation says why not it
            assert rec.tie_break is not None or other.candidate in rec.remeasure, (other.label, rec.reason)


def test_the_end_to_end_rule_rejects_a_pick_a_passing_candidate_lies_above():
    """The rule the end-to-end test judges tune's pick by, on rows whose answer is known: it fails a
    wrong pick (so the end-to-end test can), and lets the right one and a named tie stand."""

    def paired(policy, speedup, ci):
        half = [ci[0], speedup, speedup, ci[1]]
        steps = (20.0 / speedup,) * 4  # what its samples/s say agrees with its rounds (strict fp32: 20 ms)
        return BenchRow(
            "w", Candidate(policy), "cpu", 8, "ok", step_times_ms=steps, paired_ratios=tuple(half)
        )

    base = BenchRow("w", Candidate("fp32"), "cpu", 8, "ok", step_times_ms=(20.0,) * 4)
    fast = paired("bf16-mixed", 2.0, (1.9, 2.1))
    rec, ranked = decide(rows(base, fast), verdicts(verdict("bf16-mixed")))
    base = next(c.row for c in ranked if c.candidate == base.candidate)  # with its speedup, 1.0
    assert rec.candidate == fast.candidate
    assert_the_pick_stands(rec, ranked, base)
    # strict fp32 [0.985-1.015] picked over bf16-mixed [1.9-2.1]: below it
    wrong = replace(rec, candidate=Candidate("fp32"), tie_break=None, remeasure=())
    with pytest.raises(AssertionError, match="lies below bf16-mixed"):
        assert_the_pick_stands(wrong, ranked, base)
    # 1.4x [1.35-1.45]: as plainly faster; a pick of fp32 fails too (the 1.5x margin this test
    # once allowed let it through)
    clear = paired("bf16-mixed", 1.4, (1.35, 1.45))
    rec, ranked = decide(rows(base, clear), verdicts(verdict("bf16-mixed")))
    assert rec.candidate == clear.candidate
    with pytest.raises(AssertionError, match="lies below bf16-mixed"):
        assert_the_pick_stands(replace(rec, candidate=Candidate("fp32")), ranked, base)
    # 1.01x [1.00-1.02]: within noise of fp32, so fp32 stands, as a tie the recommendation names
    close = paired("bf16-mixed", 1.01, (1.0, 1.02))
    rec, ranked = decide(rows(base, close), verdicts(verdict("bf16-mixed")))
    assert rec.candidate == Candidate("fp32") and rec.tie_break
    assert_the_pick_stands(rec, ranked, base)
    with pytest.raises(AssertionError, match="bf16-mixed"):  # the same pick, its tie not named
        assert_the_pick_stands(replace(rec, tie_break=None), ranked, base)


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_tune_end_to_end_on_the_tiny_mlp(tmp_path, monkeypatch):
    # every stage with its defaults (compiled candidates, the race, the optimizer's implementations),
    # as far as 30 s takes them on the mlp: on a 2-core CPU the eager sweep, its checks, the
    # optimizer variants and the fp8 predictions, with compiling priced and declined (and said so).
    # No assertion below needs a stage to have run: what ran is judged from its own rows. (60 s
    # reached a compile and a race on a quiet machine, for 45-60 s of the suite; they have their own
    # tests: tests/tuning/test_compile_pricing.py, test_race_in_tune.py.)
    import mixprec.tuning.search as search_module

    races = []  # the race tune ran, if any: its resolved duels have the last word
    real_race = search_module.race

    def recorded(*args, **kwargs):
        races.append(real_race(*args, **kwargs))
        return races[-1]

    monkeypatch.setattr(search_module, "race", recorded)
    result = tune(
        mixprec.load_workload("mlp"), budget_s=30, steps=2, warmup=1, check_steps=3, device="cpu", lint=False
    )
    rec = result.recommendation
    assert rec is not None
    measured = {c.label: c for c in result.ranked}
    assert "fp32" in measured and "tf32" in measured and measured["tf32"].status == "unsupported"
    assert measured[rec.label].status == "recommended"
    # the pick against every candidate that passed, by the rule above on the rows' own figures (no
    # timing is compared with a constant: a pick that is wrong given what was measured fails)
    assert result.bench.baseline is not None
    assert_the_pick_stands(rec, result.ranked, result.bench.baseline, races[-1] if races else None)
    data = result.to_dict()
    # every target either exports the pick faithfully or says why it cannot
    assert set(data["exports"]) | set(data["export_refusals"]) == set(mixprec.EXPORT_TARGETS)
    assert not set(data["exports"]) & set(data["export_refusals"])
    assert {"mixprec", "pytorch"} <= set(data["exports"])
    json.dumps(data)  # serialisable


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_autotune_caches_its_decision(tmp_path, monkeypatch):
    calls = []
    import mixprec.tuning.cache as tune_mod

    real = tune_mod.tune

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tune_mod, "tune", counting)
    cache = tmp_path / "autotune.json"
    w = mixprec.load_workload("mlp")
    # what is cached, not how well it was tuned: eager candidates measured in this process (not one
    # process each), two precisions; a budget this tune cannot spend, as a pick the budget cut short
    # is not cached (30 s once asked the first tune to fit it: on a loaded machine it was tuned twice)
    opts = dict(device="cpu", cache_path=cache, budget_s=3600, check_steps=2, lint=False)
    opts.update(policies=("bf16-mixed",))
    opts.update(compile_modes=(), optimizers=False)
    opts.update(config=TuneConfig(bench=BenchConfig(steps=2, warmup=1, isolate=False)))
    first = autotune(w, **opts)
    second = autotune(w, **opts)
    assert isinstance(first.policy, mixprec.Policy) and first.candidate == second.candidate
    assert first.policy.config == second.policy.config
    assert len(calls) == 1  # the second call read the cache
    autotune(mixprec.load_workload("mlp", hidden=128), **opts)  # another model: tuned again
    assert len(calls) == 2
    assert len(json.loads(cache.read_text())["entries"]) == 2
    # a Ctrl-C reaches the tune: its answer is today's, returned and never cached
    cut = autotune(mixprec.load_workload("mlp", hidden=64), interrupt=lambda: True, **opts)
    assert len(calls) == 3 and "(not cached: stopped after" in cut.reason and "interrupt" in cut.reason
    assert len(json.loads(cache.read_text())["entries"]) == 2


def test_autotune_returns_and_caches_the_whole_pick_and_applies_it(tmp_path, monkeypatch):
    """The cache kept a PolicyConfig: a compiled, fused, accumulating pick came back as its bare
    policy, eager, with the optimizer as written and the whole batch at once."""

    import mixprec.tuning.cache as tune_mod
    from mixprec.tuning.decide import Recommendation

    pick = Candidate(
        "bf16-mixed", compile="default", optimizer="foreach", micro_batch=8, accumulation_steps=4
    )
    rec = Recommendation(pick, 1.8, None, None, {}, "fastest passing")
    calls = []

    def fake_tune(workload, **kw):
        calls.append(kw)
        return types.SimpleNamespace(
            recommendation=rec,
            workload="mlp",
            created="2026-11-27T00:00:00Z",
            budget_exhausted=None,
            interrupted=None,
        )

    monkeypatch.setattr(tune_mod, "tune", fake_tune)
    cache = tmp_path / "autotune.json"
    w = mixprec.load_workload("mlp")
    first = autotune(w, device="cpu", cache_path=cache)
    again = autotune(w, device="cpu", cache_path=cache)
    assert len(calls) == 1 and first.candidate == again.candidate == pick
    assert (again.micro_batch, again.accumulation_steps) == (8, 4)
    assert again.policy.name == "bf16-mixed" and again.reason == "fastest passing"
    model = again.prepare(torch.nn.Linear(4, 4))
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)  # compiled, as measured
    optimizer = again.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert optimizer.defaults["foreach"] is True
    assert again.compile_step(len) is len  # the model, not the step, is what this pick compiles


def test_autotune_tunes_again_when_a_tune_option_differs(tmp_path, monkeypatch):
    """The cache was keyed on the model, the device and the batch only: a pick made with a 30 s
    budget answered a call asking for 600 s. Options that make the same settings share a pick."""

    import mixprec.tuning.cache as tune_mod
    from mixprec.tuning.config import TuneConfig
    from mixprec.tuning.decide import Recommendation

    calls = []

    def fake_tune(workload, **kw):
        calls.append(kw)
        rec = Recommendation(Candidate("bf16-mixed"), 1.8, None, None, {}, "fastest passing")
        return types.SimpleNamespace(
            recommendation=rec,
            workload="mlp",
            created="2026-11-27T00:00:00Z",
            budget_exhausted=None,
            interrupted=None,
        )

    monkeypatch.setattr(tune_mod, "tune", fake_tune)
    w, cache = mixprec.load_workload("mlp"), tmp_path / "autotune.json"
    autotune(w, device="cpu", cache_path=cache, budget_s=30)
    autotune(w, device="cpu", cache_path=cache, budget_s=30)
    assert len(calls) == 1  # the same options: the cached pick
    autotune(w, device="cpu", cache_path=cache, budget_s=600)
    assert len(calls) == 2 and calls[1]["budget_s"] == 600
    autotune(w, device="cpu", cache_path=cache, config=TuneConfig(budget_s=600))  # the same settings
    assert len(calls) == 2
    autotune(w, device="cpu", cache_path=cache, budget_s=600, check_steps=12)  # a nested one differs
    assert len(calls) == 3
    autotune(w, device="cpu", cache_path=cache)
    autotune(w, device="cpu", cache_path=cache, budget_s=TuneConfig().budget_s)  # the default, spelt out
    assert len(calls) == 4
    assert len(json.loads(cache.read_text())["entries"]) == 4


def test_report_command_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps({"kind": "bench"}))
    assert main(["report", str(bad)]) == 2
    assert "kind 'tune'" in capsys.readouterr().err


def test_only_the_baseline_row_is_called_the_strict_fp32_reference():
    """A compiled (or channels_last) fp32 row passes on fp32 numerics, but is not the reference."""
    compiled = replace(row("fp32", 80), candidate=Candidate("fp32", compile="default"))
    fused = replace(row("fp32", 85), candidate=Candidate("fp32", optimizer="fused"))
    _, table = decide(rows(row("fp32", 100), compiled, row("fp32", 90, cl=True), fused), {})
    why = {c.label: c.reason for c in table}
    assert why["fp32"] == "the strict fp32 reference"
    assert why[compiled.candidate.label] == "fp32 numerics (compiled: default)"
    assert why["fp32+cl"] == "fp32 numerics (channels_last)"
    assert why[fused.candidate.label] == "fp32 numerics (fused optimizer)"  # was "fp32 numerics ()"


@pytest.mark.slow
def test_a_speed_sweep_cut_by_its_share_is_finished_with_the_time_left(monkeypatch):
    """The speed sweep's share of the budget is what it may take first, not a cap: candidates it did
    not reach are measured once the numerics checks are done, when the budget still allows (it
    used to end with those candidates unmeasured and 'budget exhausted' at a third of the budget)."""
    import mixprec.tuning.search as search_module
    from mixprec.frameworks import framework_named
    from mixprec.hardware.device import detect

    real_sweep = search_module.run_sweep
    calls: list[list[str]] = []

    def first_sweep_cut_at_its_third_candidate(workload, framework, config, **kwargs):
        calls.append([c.label for c in config.candidates])
        if len(calls) == 1:
            kwargs = cut_at_candidate(kwargs, 3)
        return real_sweep(workload, framework, config, **kwargs)

    monkeypatch.setattr(search_module, "run_sweep", first_sweep_cut_at_its_third_candidate)
    workload = mixprec.load_workload("mlp")
    # a budget this tune cannot spend (it has no compile or optimizer stage, and the cut above is
    # forced, not timed): that the late sweep fits is then not a question of this machine's speed
    result = mixprec.tune(
        workload, budget_s=3600, steps=2, warmup=1, check_steps=3, device="cpu", lint=False,
        compile_modes=(), optimizers=False,
    )  # fmt: skip
    info = detect("cpu")
    torch_ = framework_named("torch")
    everything = [c.label for c in torch_.tune_candidates(workload, info)]
    # the first sweep planned every candidate; in its measuring order, which follows a timed probe of
    # bf16 and fp16 here (a near tie on a CPU that emulates both: the order is not recomputed here)
    assert sorted(calls[0]) == sorted(everything) and calls[0][0] == "fp32" and len(calls) >= 2
    # exactly what the first sweep did not finish (the candidate it was stopped in onwards), in order
    # (the unsupported ones already have their row, saying why: they are not swept again)
    support = {c.label: bool(torch_.support(c, info)) for c in torch_.tune_candidates(workload, info)}
    supported = [label for label in calls[0] if support[label]]
    assert calls[1] and calls[1] == supported[-len(calls[1]) :] and len(calls[1]) >= len(supported) - 3
    rows = {r.label: r for r in result.bench.rows if not r.baseline_repeat}
    assert set(rows) >= set(everything)
    assert all(rows[label].status not in ("error", "stopped") for label in calls[1]), rows
    assert result.budget_exhausted is None and result.bench.stopped is None
    late = [n for n in result.notes if "measured later with the time the numerics checks left" in n]
    assert len(late) == 1 and late[0].startswith("speed sweep stopped by the deadline")


@pytest.mark.slow
def test_a_late_sweep_that_takes_all_its_time_leaves_the_check_of_what_it_found(monkeypatch):
    """A busy machine: the first sweep is cut after strict fp32, and the late sweep takes every second
    it is given (each candidate as slow as the machine allows). It used to be given the whole
    budget, so a lower precision it measured faster than fp32 could not be checked and was not
    recommended (`make demo` beside two busy processes: fp32+cl picked, bf16-mixed at ~2x unchecked).
    The late sweep leaves one check's time: whatever it measured fastest among the lower precisions
    is judged.

    No timing decides it: the budget's clock jumps to the late sweep's deadline once that sweep is
    done (it took all its time) and stands there, so what is left is exactly what the late sweep
    kept; every lower precision counts as faster than strict fp32 (on an AVX2-only CPU none is),
    and none is pruned. (It slept out the late sweep's time before: 35 s, and a skip wherever bf16
    was no faster than fp32.)"""
    import mixprec.tuning.search as search_module
    from mixprec.frameworks import framework_named

    real_sweep = search_module.run_sweep
    late_budgets = []
    clock = {"frozen_at": None}

    def now() -> float:
        return clock["frozen_at"] if clock["frozen_at"] is not None else time.perf_counter()

    def busy_machine(workload, framework, config, **kwargs):
        budget = kwargs["budget"]
        if not late_budgets and len(config.candidates) > 1 and config.baseline is None:
            late_budgets.append(None)  # the first sweep: stopped once strict fp32 is measured
            return real_sweep(workload, framework, config, **cut_at_candidate(kwargs, 2))
        late_budgets.append(budget)
        result = real_sweep(workload, framework, config, **kwargs)
        if len(late_budgets) == 2:  # the late sweep: it took all its time on a busy machine
            clock["frozen_at"] = budget.deadline
        return result

    monkeypatch.setattr(search_module, "run_sweep", busy_machine)
    monkeypatch.setattr("mixprec.clock.now", now)
    measured_speed = search_module.speed
    monkeypatch.setattr(search_module, "speed", lambda row: measured_speed(row) + 1.0)
    # two lower precisions for the late sweep, and none of the stages after the checks (the race,
    # the fp8 predictions): what is judged is settled by then
    torch_ = type(framework_named("torch"))
    plan = torch_.tune_candidates
    monkeypatch.setattr(
        torch_,
        "tune_candidates",
        lambda self, workload, info: [
            c for c in plan(self, workload, info) if c.label in ("fp32", "bf16-mixed", "fp16-mixed")
        ],
    )
    monkeypatch.setattr(search_module.Search, "race_finalists", lambda self: None)
    from mixprec.tuning.checks import Checks

    monkeypatch.setattr(Checks, "predict", lambda self, info: ({}, []))
    workload = mixprec.load_workload("mlp", hidden=32, depth=1)
    result = mixprec.tune(
        workload, budget_s=300, steps=2, warmup=1, check_steps=3, device="cpu", lint=False,
        compile_modes=(), optimizers=False, bench=replace(TuneConfig().bench, prune_factor=1e6),
    )  # fmt: skip
    assert len(late_budgets) >= 2 and late_budgets[1] is not None  # there was a late sweep
    assert clock["frozen_at"] is not None
    rows = [r for r in result.bench.rows if r.status == "ok" and not r.baseline_repeat]
    lower = [r for r in rows if r.policy != "fp32"]
    assert lower, [(r.label, r.status) for r in result.bench.rows]  # the late sweep measured some
    fastest = max(lower, key=lambda r: r.speedup_vs_fp32 or 0.0)
    judged = {c.candidate.numerics for c in result.check.candidates} if result.check else set()
    assert fastest.candidate.numerics in judged, (fastest.label, result.notes)


def test_an_at_risk_candidate_is_not_recommended_and_its_row_says_why():
    measured = rows(row("fp32", 100), row("fp16-mixed", 300), row("bf16-mixed", 250))
    risk = "at risk: layer 'head': its outputs, predicted to overflow fp16 (|x| > 65504) at about step 133"
    at_risk = replace(verdict("fp16-mixed", ok=False, reason=risk), verdict="at-risk")
    rec, table = decide(measured, verdicts(at_risk, verdict("bf16-mixed")))
    assert rec.candidate.policy == "bf16-mixed"
    status = {c.label: (c.status, c.reason) for c in table}
    assert status["fp16-mixed"] == ("at-risk", risk)
    assert f"fp16-mixed rejected: {risk}" in rec.reason


def test_autotune_does_not_cache_a_pick_the_budget_cut_short(tmp_path, monkeypatch):
    """A loaded machine's 30 s tune ended "strict fp32 by default, not by measurement" (exit 5), and
    autotune cached it: every later call, quiet or not, got fp32 from the cache."""
    import mixprec.tuning.cache as tune_mod
    from mixprec.tuning.decide import Recommendation

    cut = ["the speed sweep stopped by the deadline before bf16-mixed"]

    def fake_tune(workload, **kw):
        rec = Recommendation(Candidate("fp32"), 1.0, None, None, {}, "strict fp32 by default")
        exhausted = cut.pop() if cut and not interrupted else None
        return types.SimpleNamespace(
            recommendation=rec,
            workload="mlp",
            created="2026-11-27T00:00:00Z",
            budget_exhausted=exhausted,
            interrupted=interrupted.pop() if interrupted else None,
        )

    monkeypatch.setattr(tune_mod, "tune", fake_tune)
    w, cache = mixprec.load_workload("mlp"), tmp_path / "autotune.json"
    # a tune a Ctrl-C stopped (the CLI's interrupt) is today's answer too
    interrupted = ["stopped after 10 s of its 30 s budget: the speed sweep stopped by an interrupt"]
    stopped = autotune(w, device="cpu", cache_path=cache, budget_s=30)
    assert "not cached: stopped after 10 s" in stopped.reason
    assert not cache.exists() or not json.loads(cache.read_text()).get("entries")
    first = autotune(w, device="cpu", cache_path=cache, budget_s=30)
    assert first.candidate == Candidate("fp32") and "not cached: the speed sweep stopped" in first.reason
    assert not cache.exists() or not json.loads(cache.read_text()).get("entries")
    autotune(w, device="cpu", cache_path=cache, budget_s=30)  # tuned again, settled: cached
    assert len(json.loads(cache.read_text())["entries"]) == 1
