"""A failure that comes late: the example's head outgrows fp16 after ~140 steps of a plain
torch.amp loop. A default `check` (8 steps) must call fp16-mixed at-risk, name the head, predict
the step within 2x of the plain loop's, and verify its fix past that step; bf16-mixed passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.checking.check import check, cured
from mixprec.cli import main

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "late_overflow.py") + ":workload"


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """A tiny model: one thread (see conftest.single_thread)."""


def first_fp16_overflow_in_a_plain_loop(steps: int = 300) -> int | None:
    """The step where a plain autocast(fp16) + GradScaler loop first overflows (its loss is not
    finite: the head's fp16 output passed 65504), or None."""
    w = mixprec.load_workload(EXAMPLE)
    torch.manual_seed(0)
    optimizer = w.optimizer_fn(w.model)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(steps):
        batch = w.make_batch(w.default_batch_size, torch.device("cpu"))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = w.loss_fn(w.model, batch)
        if not torch.isfinite(loss):
            return step
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return None


def test_a_default_check_sees_the_late_overflow_coming_and_its_fix_outlasts_it():
    overflow = first_fp16_overflow_in_a_plain_loop()
    assert overflow is not None and overflow > 50, overflow  # late: far past a check's steps

    result = check(
        mixprec.load_workload(EXAMPLE), policies=["fp16-mixed", "bf16-mixed"], device="cpu", fix=True
    )
    by = {c.label: c for c in result.candidates}
    fp16, bf16 = by["fp16-mixed"], by["bf16-mixed"]
    assert fp16.verdict == "at-risk", fp16.reason
    assert "'head'" in fp16.reason and "predicted to overflow fp16" in fp16.reason
    # the run it is about named as the setting it is, not read as the user's run of 10000 steps
    assert "of the 10000-step run (--train-steps)" in fp16.reason, fp16.reason
    predicted = fp16.outlook["at_risk"]["step"]
    assert overflow / 2 <= predicted <= overflow * 2, (predicted, overflow)
    assert fp16.fix_keep_fp32 == ["head"] and fp16.fix_verified, fp16.fix_note
    verified_steps = int(fp16.fix_metrics["steps"])
    assert verified_steps > max(predicted, overflow), (verified_steps, predicted, overflow)
    assert bf16.verdict == "pass", bf16.reason


def test_the_cli_exits_4_on_at_risk_and_says_where(capsys):
    code = main(["check", "--workload", EXAMPLE, "--policies", "fp16-mixed", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 4
    assert "at-risk" in out and "head" in out and "(--train-steps)" in out


def test_a_rescue_says_what_it_cured_in_the_figures_both_checks_measured():
    w = mixprec.load_workload(EXAMPLE)
    rejected = check(w, policies=["fp16-mixed"], device="cpu", fix=True).candidates[0]
    rescued_candidate = mixprec.Candidate("fp16-mixed", keep_fp32=tuple(rejected.fix_keep_fp32))
    rescued = check(mixprec.load_workload(EXAMPLE), policies=[rescued_candidate], device="cpu").candidates[0]
    assert rescued.verdict == "pass", rescued.reason
    text = cured(rejected, rescued)
    assert text.startswith("rescued: fp16-mixed was at-risk (at risk: layer 'head'")
    assert "with head kept in fp32: 'head', which the rejection named, now computes in fp32" in text
    assert text.endswith(rescued.reason)


def test_a_compiled_candidate_is_judged_over_the_run_by_its_eager_twins_ranges():
    # range hooks would change a compiled graph: the trend comes from the same candidate run eagerly
    compiled = mixprec.Candidate("fp16-mixed", compile="default")
    (result,) = check(mixprec.load_workload(EXAMPLE), policies=[compiled], device="cpu").candidates
    assert result.verdict == "at-risk", result.reason
    assert "'head'" in result.reason and result.series


def test_a_compiled_candidate_checked_after_its_eager_twin_reads_the_twins_run(monkeypatch):
    # a tune checks eager first, then compiled: the compiled check's ranges are the run the eager
    # check made (run again, it cost a compiled check of the nanoGPT on the AMX Xeon ~15 s)
    from mixprec.frameworks.torch.framework import TorchFramework

    eager, compiled = mixprec.Candidate("fp16-mixed"), mixprec.Candidate("fp16-mixed", compile="default")
    runs: list[mixprec.Candidate] = []
    trajectory = TorchFramework.trajectory

    def counted(self, workload, candidate, *args, **kwargs):
        runs.append(candidate)
        return trajectory(self, workload, candidate, *args, **kwargs)

    monkeypatch.setattr(TorchFramework, "trajectory", counted)
    first, second = check(mixprec.load_workload(EXAMPLE), policies=[eager, compiled], device="cpu").candidates
    assert runs.count(eager) == 1 and runs.count(compiled) == 1
    assert first.verdict == second.verdict == "at-risk", (first.reason, second.reason)
    assert "'head'" in second.reason and second.series == first.series


def test_a_stall_across_the_whole_model_is_not_searched_for_fp32_islands():
    # updates far below half a bf16 ulp everywhere: no few fp32 layers can cure it, and searching
    # for them used to spend make demo's whole budget on ResNet-50
    torch.manual_seed(0)
    w = mixprec.Workload(
        model=torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
        make_batch=lambda b, d: (torch.randn(b, 16), torch.randint(0, 4, (b,))),
        loss_fn=lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]).float(), batch[1]),
        optimizer_fn=lambda p: torch.optim.SGD(p, lr=1e-6),
        name="stall",
    )
    (result,) = check(w, policies=["bf16-true"], device="cpu", fix=True).candidates
    assert result.verdict == "fail" and result.stalled_update_fraction > 0.5
    assert result.fix_note.startswith("keep_fp32 search skipped:") and not result.fix_keep_fp32
