"""Which candidates tune compiles: every passing precision family once before any twice, ordered
by what compiling can gain (the elementwise share, the optimizer's share for a whole step, none of
it under a loss scaler), recalibrated by what the measurements showed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mixprec.frameworks import framework_named
from mixprec.measure.results import BenchRow
from mixprec.policy import Candidate
from mixprec.tuning.compiling import FUSION_GAIN, OPTIMIZER_GAIN, Calibration, families, plan, predicted_gain

TORCH = framework_named("torch")


def row(
    policy: str, speedup: float, compute: float | None = 0.5, optimizer: float | None = 0.2, **axes
) -> BenchRow:
    return BenchRow(
        "gpt", Candidate(policy, **axes), "cpu", 8, "ok", speedup_vs_fp32=speedup,
        compute_share=compute, optimizer_share=optimizer,
    )  # fmt: skip


def test_the_gain_of_a_scope_comes_from_where_the_eager_step_spends_its_time():
    eager = row("bf16-mixed", 1.2, compute=0.5, optimizer=0.2)
    model, _ = predicted_gain(eager, None, loss_scaled=False)
    step, basis = predicted_gain(eager, "step", loss_scaled=False)
    assert model == pytest.approx(FUSION_GAIN * 0.3) and step == pytest.approx(
        FUSION_GAIN * 0.3 + OPTIMIZER_GAIN * 0.2
    )
    assert "30% of its step outside" in basis and "20% in the optimizer" in basis
    scaled, why = predicted_gain(eager, "step", loss_scaled=True)
    assert scaled == pytest.approx(model) and "loss scaler's step stays eager" in why


def test_each_passing_family_is_compiled_once_before_any_twice_best_prediction_first():
    rows = [
        row("fp32", 1.0, compute=0.6, optimizer=0.3),
        row("bf16-mixed", 1.3, compute=0.3, optimizer=0.1),  # much elementwise: compile gains a lot
        row("bf16-mixed", 1.1, compute=0.3, optimizer=0.1, channels_last=True),  # the slower layout
        row("bf16-true", 1.8, compute=0.8, optimizer=0.15),
        row("fp16-mixed", 1.9),  # failed its check: not a family (an unchecked one would be)
    ]
    failed = {Candidate("fp16-mixed")}
    assert {r.label for r in families(rows, failed)} == {"fp32", "bf16-mixed", "bf16-true"}
    attempts = plan(TORCH, rows, failed, ["default"], Calibration())
    first_three = [a.candidate for a in attempts[:3]]
    assert {c.policy for c in first_three} == {"fp32", "bf16-mixed", "bf16-true"}  # one per family first
    assert all(c.compile_scope == "step" for c in first_three)  # the optimizer's share makes step win
    assert [a.speedup for a in attempts[:3]] == sorted((a.speedup for a in attempts[:3]), reverse=True)
    assert {a.candidate.compile_scope for a in attempts[3:]} == {None}  # then the model scope
    assert not any(a.candidate.channels_last for a in attempts)  # the family's fastest layout


def test_a_measurement_recalibrates_the_prediction_of_its_scope():
    eager = row("fp32", 1.0, compute=0.4, optimizer=0.0)
    attempts = plan(TORCH, [eager], set(), ["default"], Calibration())
    assert attempts[0].candidate.compile_scope is None  # no optimizer share: the simpler scope first
    attempt = attempts[0]
    assert attempt.gain == pytest.approx(FUSION_GAIN * 0.6)
    calibration = Calibration()
    calibration.update(attempt, replace(eager, candidate=attempt.candidate, speedup_vs_fp32=0.9))
    assert calibration.of(None) == 0  # compiling the model made it slower here: predict no gain
    again = plan(TORCH, [eager], set(), ["default"], calibration)
    assert next(a for a in again if a.candidate.compile_scope is None).speedup == pytest.approx(1.0)
