"""A third framework, written in one file (``toy.py``) and registered at run time, goes through
bench, check, tune and the CLI with no change to mixprec: the seam is the Framework interface."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mixprec
from mixprec.cli import main
from mixprec.frameworks import framework_named, framework_of, register_framework, unregister_framework

from .toy import ToyFramework, ToyWorkload


@pytest.fixture(autouse=True)
def toy():
    register_framework(ToyFramework())
    yield
    unregister_framework("toy")


def test_the_registry_finds_the_backend_of_a_toy_workload():
    assert framework_of(ToyWorkload()) is framework_named("toy")
    with pytest.raises(mixprec.UsageError, match=r"tests\.frameworks\.toy\.ToyWorkload"):
        framework_of(object())


def test_bench_pairs_the_toy_candidates_and_says_why_the_rest_cannot_run():
    result = mixprec.bench(ToyWorkload(), policies="fp32,fp16-true,bf16-mixed", steps=2, warmup=1)
    rows = {r.label: r for r in result.rows}
    assert rows["fp32"].status == "ok" and rows["fp16-true"].status == "ok"
    assert rows["fp16-true"].paired_ratios and rows["fp16-true"].observed_dtype == "float16"
    assert (
        rows["bf16-mixed"].status == "unsupported" and "NumPy has no bf16-mixed" in rows["bf16-mixed"].reason
    )
    assert all(r.candidate.framework == "toy" for r in result.rows)
    assert result.settings["framework"] == "toy" and "no FLOP count" in " ".join(result.notes)


def test_check_judges_the_toy_against_its_fp32_reference():
    with np.errstate(over="ignore", invalid="ignore"):
        calm = mixprec.check(ToyWorkload(), policies=["fp16-true"], steps=4)
        loud = mixprec.check(ToyWorkload(scale=3000.0), policies=["fp16-true"], steps=4)
    assert calm.candidates[0].verdict == "pass", calm.candidates[0].reason
    assert loud.candidates[0].verdict == "fail" and "non-finite" in loud.candidates[0].reason
    assert loud.candidates[0].worst_layers[0]["layer"] == "linear"


def test_tune_recommends_and_exports_in_the_toy_framework():
    result = mixprec.tune(ToyWorkload(), budget_s=30, steps=2, warmup=1, check_steps=3)
    rec = result.recommendation
    assert (
        rec is not None and rec.candidate.framework == "toy" and rec.candidate.policy in ("fp32", "fp16-true")
    )
    assert result.exports["numpy"].startswith("w = w.astype(np.float")
    assert result.lint is None  # no linter for this framework
    data = json.loads(json.dumps(result.to_dict()))
    assert data["recommendation"]["candidate"]["framework"] == "toy"


def test_the_cli_takes_the_toy_framework(tmp_path, capsys):
    out = tmp_path / "b.json"
    code = main(
        ["bench", "--framework", "toy", "--policies", "fp32,fp16-true", "--steps", "1", "--json", str(out)]
    )
    assert code == 0, capsys.readouterr().err
    assert [r["label"] for r in json.loads(out.read_text())["rows"]] == ["fp32", "fp16-true"]


def test_a_baseline_that_crashes_mid_sweep_ends_the_sweep_not_the_candidate():
    """Strict fp32's session raising during a candidate's paired rounds is strict fp32's failure: the
    candidate is not blamed for it, the sweep stops with the reason and keeps fp32's timed steps (the
    H200's script tune blamed every later candidate with BrokenPipeError, then lost every row)."""
    # fp32 steps 3 times before the candidate (1 warm-up, 2 timed), then at least once a round: its
    # step 4 falls in fp16-true's second round at the latest, whatever the machine's speed
    result = mixprec.bench(ToyWorkload(fp32_fails_at=4), policies="fp32,fp16-true", steps=2, warmup=1)
    rows = {r.label: r for r in result.rows}
    assert "fp16-true" not in rows or rows["fp16-true"].status != "error", rows["fp16-true"].reason
    assert result.stopped and "strict fp32's session ended: RuntimeError: corrupt shard" in result.stopped
    assert "while measuring fp16-true" in result.stopped
    fp32 = rows["fp32"]
    assert fp32.status == "ok" and len(fp32.step_times_ms) >= 2
    assert any("its session ended during the sweep" in n for n in fp32.notes)


def test_tune_over_a_baseline_that_crashes_mid_sweep_does_not_call_it_the_budget():
    """The sweep stopped by strict fp32's crash is not the budget running out: tune says why, keeps
    going with what it has, and does not send the user to raise --budget (exit 5)."""
    result = mixprec.tune(ToyWorkload(fp32_fails_at=4), budget_s=30, steps=2, warmup=1, check_steps=3)
    assert result.budget_exhausted is None
    assert result.bench.baseline_ended and "corrupt shard at step 4" in result.bench.baseline_ended
    assert any("strict fp32's session ended: RuntimeError: corrupt shard" in n for n in result.notes)
    data = json.loads(json.dumps(result.to_dict()))
    assert "corrupt shard" in data["bench"]["baseline_ended"]
