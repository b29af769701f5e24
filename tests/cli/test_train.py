"""`mixprec train`: the long-run ground truth in one command; its exit code says whether the run
ended healthy, and a rescue is written back as the policy for the next run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixprec.cli import main

LATE = str(Path(__file__).parents[2] / "examples" / "late_overflow.py") + ":workload"


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """A tiny model: one thread (see conftest.single_thread)."""


def _train(tmp_path, *extra):
    argv = ["train", "--workload", LATE, "--policy", "fp16-mixed", "--steps", "300", "--every", "20"]
    return main([*argv, "--device", "cpu", "--out", str(tmp_path), *extra])


def test_train_alerts_without_rescue_and_exits_4(tmp_path, capsys):
    assert _train(tmp_path) == 4
    out = capsys.readouterr().out
    assert "predicted_overflow [head]" in out and "the run ended not healthy" in out
    data = json.loads((tmp_path / "train.json").read_text())
    assert data["kind"] == "train" and len(data["losses"]) == 300 and data["final_policy"]["keep_fp32"] == []
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events[0]["kind"] == "predicted_overflow" and events[0]["module"] == "head"
    assert (tmp_path / "train.png").stat().st_size > 0


def test_train_with_rescue_ends_healthy_with_the_policy_for_the_next_run(tmp_path, capsys):
    assert _train(tmp_path, "--rescue") == 0
    out = capsys.readouterr().out
    assert "rescue [head]" in out and "the policy for the next run: fp16-mixed keep_fp32=['head']" in out
    data = json.loads((tmp_path / "train.json").read_text())
    assert data["final_policy"]["keep_fp32"] == ["head"] and data["healthy"] is True
    assert all(isinstance(v, float) for v in data["losses"])  # all finite


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "fp17"], "--policy: Unknown policy 'fp17'"),
        (["--shadow-every", "-1"], "--shadow-every must be >= 0, got -1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code = main(["train", "--workload", LATE, "--steps", "5", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
