"""The Keras tune is the torch one (one search over the backend): it has the budget, tie, late-sweep
and exit-code behaviour, where its own copy once had none of them."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

import mixprec
from sweep_cuts import cut_at_candidate

if os.environ.get("MIXPREC_REQUIRE_FRAMEWORKS") == "1":
    import tensorflow  # noqa: F401  (make test installs the extra: a missing one is a failure)
else:
    pytest.importorskip("tensorflow", reason="tensorflow is not installed: pip install -e '.[tensorflow]'")

from mixprec.cli import main
from mixprec.frameworks.keras.framework import KerasFramework
from mixprec.keras import load_keras_workload

pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]
STEPS = 2


@pytest.fixture(autouse=True)
def _bf16_in_the_plan(monkeypatch):
    """Tune's plan on every CPU as on one with native bf16 (AVX512-BF16 or AMX): strict fp32,
    bf16-mixed and bf16-true. The Keras plan has natively computed policies only, so on an AVX2-only
    CPU it is strict fp32 alone, with nothing for a budget to cut or for finalists to race; these
    tests are about the search, and Keras' bf16 runs there anyway (emulated; the mlp's step is
    overhead-bound, about as fast as fp32's)."""
    plan = KerasFramework.tune_candidates
    monkeypatch.setattr(
        KerasFramework,
        "tune_candidates",
        lambda self, workload, info: plan(
            self, workload, replace(info, cpu_flags=info.cpu_flags | {"avx512_bf16"})
        ),
    )


def test_a_keras_tune_out_of_budget_says_so_and_exits_5(capsys):
    """The Keras tune used to show a budget-cut pick of strict fp32 as a verdict and exit 0. A budget
    no machine measures the plan in (strict fp32 is still measured: a step under way is finished),
    so the cut is certain, not a question of how fast this one is (it was 4 s)."""
    code = main(["tune", "--framework", "tensorflow", "--model", "mlp", "--budget", "0.01", "--no-compile"])
    captured = capsys.readouterr()
    assert code == 5, captured.err
    assert "budget exhausted" in captured.out + captured.err


def test_a_keras_tune_finishes_a_cut_speed_sweep_and_races_its_finalists(monkeypatch):
    """The speed sweep's share is a first claim, not a cap (candidates it did not reach are measured
    later), and the finalists are measured against each other before the pick: both once torch-only."""
    import mixprec.measure.race as race_module
    import mixprec.tuning.search as search

    real_sweep = search.run_sweep
    calls: list[list[str]] = []

    def first_sweep_cut_after_strict_fp32(workload, framework, config, **kwargs):
        calls.append([c.label for c in config.candidates])
        if len(calls) == 1:
            kwargs = cut_at_candidate(kwargs, 2)
        return real_sweep(workload, framework, config, **kwargs)

    monkeypatch.setattr(search, "run_sweep", first_sweep_cut_after_strict_fp32)
    # strict fp32 and bf16-mixed alone: one candidate for the late sweep and one duel for the race
    # are what this is about (bf16-true, a third Keras session and check, cost a fifth of the time)
    plan = KerasFramework.tune_candidates
    monkeypatch.setattr(
        KerasFramework,
        "tune_candidates",
        lambda self, workload, info: [
            c for c in plan(self, workload, info) if c.policy in ("fp32", "bf16-mixed")
        ],
    )
    monkeypatch.setattr(search, "RACE_WINDOW", 1.0)  # every passing candidate is a finalist
    # ...on any CPU: only a candidate measured faster than strict fp32 has its numerics checked, and
    # only a checked one can race; on a CPU where Keras' bf16 is no faster (the mlp is a toss-up on
    # a 2-core EPYC, slower on a Xeon without AMX) nothing raced and this test failed
    measured_speed = search.speed
    monkeypatch.setattr(search, "speed", lambda row: measured_speed(row) + 1.0)
    # one call of paired rounds per duel: that the finalists race, not how far the halving goes
    # (tests/measure/test_race.py); a close duel used to take three calls of fresh processes
    monkeypatch.setattr(race_module, "MAX_ROUNDS", race_module.FIRST_ROUNDS)
    # a budget this tune cannot spend (no compile stage, one call of rounds per duel, and the cut
    # above is forced): that the late sweep and the race fit is not a question of this machine's
    # speed (python benchmarks/budget_fits.py --only keras-late-sweep-and-race times it at 240 s)
    # The mlp without its spec: the search measures and races its candidates in this process, where
    # TensorFlow is imported already, instead of starting a fork server that imports it again (about
    # 9 s of its 17-22 s on a 2-core CPU). The search is this test's subject; Keras candidates in
    # their own processes are test_keras.py's (the bench pairs and the tune there).
    result = mixprec.tune(
        replace(load_keras_workload("mlp"), spec=None),
        budget_s=3600,
        steps=2,
        warmup=1,
        check_steps=2,
        compile_modes=(),
        device="cpu",
        # the pick's figure is not settled: settling is the search's next stage, tested where it is
        # the subject (tests/tuning/test_settled_figure.py, the end-to-end tunes); here it was half
        # the test's time, its extra sessions of Keras rounds
        settle=0.0,
    )
    assert calls[:2] == [["fp32", "bf16-mixed"], ["bf16-mixed"]], calls  # the first sweep and the late one
    late = [n for n in result.notes if "measured later with the time the numerics checks left" in n]
    assert len(late) == 1, result.notes
    raced = [n for n in result.notes if n.startswith("race: ")]
    assert raced and all("paired rounds" in n for n in raced), result.notes
    assert result.recommendation is not None and result.budget_exhausted is None
    assert set(result.phases) >= {"speed", "numerics", "race", "other"}
