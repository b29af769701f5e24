"""A candidate pruned by one stalled step, not by its speed, is measured again: on the AMX Xeon VM
(2026-11-30) one bf16-mixed step of ResNet-50 ran past the prune limit after paired rounds at
1.88x strict fp32, the speed sweep's share of tune's budget was spent before its retry, and the row
stood as "pruned" for good. On planted step times (tests/tuning/scripted.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import mixprec
import mixprec.tuning.search as search_module
from mixprec.measure.results import BenchRow
from mixprec.measure.sweep import stalled
from mixprec.policy import Candidate

from .scripted import Planted, planted_clock, planted_framework  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("planted_clock", "planted_framework")


def test_a_stalled_step_that_the_sweep_had_no_time_to_retry_is_measured_later(monkeypatch):
    real_sweep = search_module.run_sweep
    sweeps: list[list[str]] = []

    def share_spent_once_the_last_row_is_in(workload, framework, config, **kwargs):
        sweeps.append([c.label for c in config.candidates])
        if len(sweeps) == 1:  # the first sweep's share ends after its last candidate: no retry
            rows: list[str] = []
            forward = kwargs["events"]

            def events(event):
                if event["event"] == "row":
                    rows.append(event["row"].label)
                forward(event)

            budget = replace(kwargs["budget"], stop=lambda: "fp16-mixed" in rows)
            kwargs = {**kwargs, "events": events, "budget": budget}
        return real_sweep(workload, framework, config, **kwargs)

    monkeypatch.setattr(search_module, "run_sweep", share_spent_once_the_last_row_is_in)
    planted = Planted(
        {"fp32": 1.0, "bf16-mixed": 0.5, "fp16-mixed": 0.9}, jitter=0.0, stalls={"bf16-mixed": 2}
    )
    result = mixprec.tune(
        planted, budget_s=3600, steps=4, warmup=1, check_steps=2, compile_modes=(), optimizers=False
    )
    row = next(r for r in result.bench.rows if r.label == "bf16-mixed" and not r.baseline_repeat)
    assert row.status == "ok" and row.speedup_vs_fp32 == pytest.approx(2.0, rel=0.05), (
        row.status,
        row.reason,
    )
    assert any(n.startswith("pruned on the first attempt (step 2 took") for n in row.notes), row.notes
    assert [r.label for r in result.bench.rows].count("bf16-mixed") == 1  # replaced, not a second row
    assert result.recommendation is not None and result.recommendation.candidate.policy == "bf16-mixed"
    assert sweeps[0][-1] == "fp16-mixed" and sweeps[1] == ["bf16-mixed"], sweeps  # the late part
    assert any("bf16-mixed measured later with the time the numerics checks left" in n for n in result.notes)


def _pruned(ratios, reason="step 3 took 6.4 s (limit 4.0 s)", notes=()):
    return BenchRow(
        "w", Candidate("bf16-mixed"), "cpu", 8, "pruned", reason, paired_ratios=ratios, notes=notes
    )


def test_only_a_prune_its_own_rounds_contradict_counts_as_a_stall():
    best = BenchRow("w", Candidate("bf16-true"), "cpu", 8, "ok", paired_ratios=(2.0, 2.1, 1.9))
    assert stalled([best, _pruned((1.9, 1.85))], prune_factor=5.0) == [_pruned((1.9, 1.85))]
    assert stalled([best, _pruned((0.30, 0.35))], prune_factor=5.0) == []  # its rounds say hopeless
    assert stalled([best, _pruned(())], prune_factor=5.0) == []  # pruned warming up: nothing says more
    assert stalled([best, _pruned((1.9,), reason="pruned twice: ...")], prune_factor=5.0) == []
    assert stalled([best, _pruned((1.9,), notes=("not retried: emulated here",))], prune_factor=5.0) == []
