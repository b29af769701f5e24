"""`mixprec train`'s inputs and outputs are checked before it trains, and a run cut short keeps what
it measured (issue 39): the README's policy aliases and closest match, the --out files checked
first, a workload that fails on its own refused in one line with exit 2 before the run, Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mixprec.cli import main
from mixprec.errors import UsageError
from mixprec.monitor import Monitor

TINY = str(Path(__file__).with_name("train_workloads.py")) + ":workload"


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """A tiny model: one thread (see conftest.single_thread)."""


def _train(tmp_path: Path, *extra: str) -> int:
    return main(
        ["train", "--workload", TINY, "--steps", "3", "--device", "cpu", "--out", str(tmp_path), *extra]
    )


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_policy_aliases_train_and_a_misspelling_names_the_closest(tmp_path, capsys):
    assert _train(tmp_path, "--policy", "fp16") == 0
    assert json.loads((tmp_path / "train.json").read_text())["policy"] == "fp16-mixed"
    capsys.readouterr()
    assert _train(tmp_path, "--policy", "bf16-mix") == 2
    err = _one_line(capsys)
    assert "--policy" in err and "'bf16-mix'" in err and "Did you mean 'bf16-mixed'?" in err
    assert "fp16-mixed" in err  # the valid ones


def test_out_files_are_checked_before_the_run(tmp_path, capsys):
    """A train.json that is a link, an events.jsonl that is a folder: refused before one step
    (the run's figures were lost after it trained, or an IsADirectoryError traceback)."""
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "train.json").symlink_to(tmp_path / "elsewhere.json")
    progress = tmp_path / "progress.txt"
    assert _train(linked, "--model-config", f"progress={progress}") == 2
    err = _one_line(capsys)
    assert "train.json" in err and "symbolic link" in err
    assert not progress.exists()  # no batch was drawn: nothing ran
    folder = tmp_path / "folder"
    (folder / "events.jsonl").mkdir(parents=True)
    assert _train(folder, "--model-config", f"progress={progress}") == 2
    err = _one_line(capsys)
    assert "events.jsonl" in err and "is a directory" in err
    assert not progress.exists()


def test_a_monitor_refuses_a_findings_path_that_is_a_folder_when_made(tmp_path):
    with pytest.raises(UsageError, match="is a directory"):
        Monitor(torch.nn.Linear(2, 2), findings=tmp_path)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("vector", "loss_fn returned a tensor of shape (8,); return a scalar"),
        ("frozen", "the model has no parameter that requires grad"),
        ("nanloss", "loss_fn returned nan at the first strict-fp32 step"),
    ],
)
def test_a_workload_that_fails_on_its_own_is_exit_2_before_the_run(tmp_path, capsys, fault, message):
    """As bench and check: one strict-fp32 step first, one line naming the function (it was exit 4,
    "not healthy", after the whole run)."""
    assert _train(tmp_path, "--model-config", f"fault={fault}") == 2
    assert message in _one_line(capsys)
    assert not (tmp_path / "train.json").exists()


def test_ctrl_c_keeps_what_the_run_measured(tmp_path):
    """SIGINT mid-run: exit 130, train.json with every finished step, a `stop` line in events.jsonl
    naming the step, no lock left behind (all were lost, and the lock stayed)."""
    out, progress = tmp_path / "out", tmp_path / "progress.txt"
    argv = ["train", "--workload", TINY, "--model-config", f"progress={progress}", "--steps", "1000000"]
    argv += ["--device", "cpu", "--out", str(out)]
    # Python's own Ctrl-C handler, even where this test's runner ignores SIGINT (a background job)
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"from mixprec.cli import main; sys.exit(main({argv!r}))"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        hung = time.monotonic() + 600  # a guard against a hang, not a timing
        while not progress.exists() or len(progress.read_text().splitlines()) < 20:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < hung, "the run never got under way"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, stderr
    data = json.loads((out / "train.json").read_text())
    steps = len(data["losses"])
    assert steps >= 10 and data["healthy"] is False
    assert data["stopped"].startswith(f"interrupted at step {steps} of 1000000")
    assert f"interrupted at step {steps} of 1000000" in stderr and "mixprec: interrupted" in stderr
    last = json.loads((out / "events.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "stop" and last["step"] == steps
    assert not list(out.glob(".*.lock")), sorted(p.name for p in out.iterdir())
