"""Progress everywhere: off a terminal (CI logs, nohup, a captured notebook cell, | tee) bench,
check and tune print one plain line per finished candidate with its status, figure, elapsed time
and time left; on a terminal a live bar shows the same lines above it."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

import mixprec
from mixprec.cli import main
from mixprec.cli.progress import CandidateProgress
from mixprec.report.progress import clock, progress_line

LINE = re.compile(
    r"^(\[\d+/\d+\] )?(numerics of )?[\w+\-=(),\[\]' ]+: \S+.*"
    r"  \(elapsed \d+:\d\d(, (eta|at most) \d+:\d\d.*)?\)$"
)


def test_line_format():
    assert clock(5) == "0:05" and clock(125) == "2:05" and clock(3725) == "1:02:05"
    line = progress_line("bf16-mixed", "ok", "1.5 samples/s", elapsed_s=42, eta_s=90, position=(2, 3))
    assert line == "[2/3] bf16-mixed: ok 1.5 samples/s  (elapsed 0:42, eta 1:30)"
    budget = progress_line("fp32", "pass", "", elapsed_s=61, eta_s=10, eta_is_budget=True)
    assert budget == "fp32: pass  (elapsed 1:01, at most 0:10 left (budget))"


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
def test_bench_events_become_one_line_per_candidate(terminal):
    buffer = io.StringIO()
    err = Console(file=buffer, force_terminal=terminal, width=200)
    with CandidateProgress(err, "bench") as shown:
        assert shown.live is terminal
        mixprec.bench(
            mixprec.load_workload("mlp"),
            policies="fp32,bf16-mixed",
            channels_last="off",
            steps=1,
            warmup=1,
            isolate=False,
            device="cpu",
            events=shown.event,
        )
    text = buffer.getvalue()
    if terminal:  # the lines are printed above the live bar: strip its control sequences
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    lines = [line for line in text.splitlines() if "elapsed" in line]
    assert [line.split(":")[0] for line in lines] == ["[1/2] fp32", "[2/2] bf16-mixed", "[1/2] fp32 (again)"]
    assert "samples/s" in lines[1] and "x fp32" in lines[1] and "eta 0:00" in lines[1]
    if not terminal:
        assert text == "".join(line + "\n" for line in lines)  # nothing else in a log


@pytest.mark.slow
def test_a_captured_check_prints_one_line_per_candidate(capsys):
    # an explicitly named unsupported policy exits 3 before any checking (tests/test_hardening.py):
    # bf32 only where this CPU has it (AVX512-BF16 or AMX, not an AVX2-only one)
    cpu = mixprec.detect("cpu")
    policies = [p for p in ("bf16-mixed", "fp16-mixed", "bf32") if mixprec.check_support(p, cpu)]
    argv = ["check", "--model", "mlp", "--policies", ",".join(policies), "--steps", "2"]
    assert main([*argv, "--device", "cpu"]) == 0
    # (a CPU where fp16 or bf16 is slow adds a "note: warning: fp16-mixed: fp16 is slow ..." line first)
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note: warning:")]
    n = len(policies)
    assert [line.split(":")[0] for line in lines] == [f"[{i}/{n}] {p}" for i, p in enumerate(policies, 1)]
    assert all(LINE.match(line) for line in lines), lines
    assert "max loss diff" in lines[0] and "output SQNR" in lines[0] and "max loss diff" in lines[-1]


@pytest.mark.slow
def test_a_captured_tune_prints_one_line_per_candidate(capsys, tmp_path):
    # exit 0 asks the tune to finish its work, bounded by what it searches (eager, the optimizer as
    # written, no rescue search), not by a clock: a budget it cannot spend
    argv = ["tune", "--model", "mlp", "--budget", "3600", "--no-compile", "--no-optimizers", "--no-lint"]
    argv += ["--steps", "2", "--check-steps", "2", "--no-fix", "--device", "cpu"]
    assert main([*argv, "--json", str(tmp_path / "tune.json")]) == 0
    # torch may log a warning of its own on stderr (e.g. cpp_extension's "No CUDA runtime")
    lines = [line for line in capsys.readouterr().err.splitlines() if "(elapsed" in line]
    assert lines and all(LINE.match(line) for line in lines), lines
    assert all("(budget)" in line for line in lines)
    labels = [line.split(":")[0] for line in lines]
    data = json.loads((tmp_path / "tune.json").read_text())
    measured = {row["label"] for row in data["bench"]["rows"]}
    rows = {label.removesuffix(" (again)") for label in labels if not label.startswith("numerics")}
    assert rows == measured
    checked = [c["label"] for c in (data["check"] or {}).get("candidates", [])]
    verdicts = [label.removeprefix("numerics of ") for label in labels if label.startswith("numerics")]
    assert verdicts == checked


@pytest.mark.parametrize(
    "name, noise",
    [
        ("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME='/usr/local'"),
        # a compiled step tracing optimizer.step(): printed amid tune's progress lines (issue 38's run)
        (
            "torch._dynamo.variables.ctx_manager",
            "Profiler record function <class 'torch.autograd.profiler.record_function'> will be ignored",
        ),
    ],
)
def test_known_third_party_noise_is_dropped_and_other_lines_kept(caplog, name, noise):
    """A compiling candidate on a CPU machine used to print cpp_extension's "No CUDA runtime" line
    once per candidate process (isolate's child calls quiet_known_noise too)."""
    import logging

    from mixprec.quiet import quiet_known_noise

    quiet_known_noise()
    logger = logging.getLogger(name)
    with caplog.at_level(logging.WARNING, logger=name):
        logger.warning(noise)
        logger.warning("something else worth seeing")
    assert [r.getMessage() for r in caplog.records] == ["something else worth seeing"]
