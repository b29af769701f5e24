"""The row stream's two strict-fp32 rows (issue 39): the closing one is marked as the repeat, so a
reader of the .jsonl tells them apart; the result and a resumed sweep see the closing one as the
baseline, as before."""

from __future__ import annotations

import json

import pytest

from mixprec import bench, load_workload


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """A tiny model: one thread (see conftest.single_thread)."""


def _sweep(jsonl, **overrides):
    options = dict(
        policies="fp32,bf16-mixed",
        channels_last="off",
        steps=1,
        warmup=1,
        min_time_s=0.0,
        isolate=False,
        device="cpu",
        jsonl=jsonl,
    )
    return bench(load_workload("mlp"), **{**options, **overrides})


def test_the_closing_strict_fp32_row_is_marked_as_the_repeat(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    result = _sweep(jsonl)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()][1:]  # the header first
    fp32 = [r for r in records if r["policy"] == "fp32"]
    assert [r["baseline_repeat"] for r in fp32] == [False, True]
    closing = fp32[1]
    baseline = result.baseline
    assert baseline is not None and not baseline.baseline_repeat  # the result's one fp32 row
    assert list(baseline.step_times_ms) == closing["step_times_ms"]  # ... is the closing row's
    assert [r.label for r in result.rows] == ["fp32", "bf16-mixed"]

    resumed = _sweep(jsonl, resume=True)  # a complete stream: nothing measured, the same baseline
    assert any("nothing was measured" in note for note in resumed.notes)
    assert [r.label for r in resumed.rows] == ["fp32", "bf16-mixed"]
    assert resumed.baseline is not None and list(resumed.baseline.step_times_ms) == closing["step_times_ms"]
