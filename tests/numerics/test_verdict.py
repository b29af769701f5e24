"""The verdict's bars (issue 39): noise is never a pass where the model does not make the format's
rounding noise, and a constant in the loss cannot hide a loss difference."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.numerics.compare import Trajectory, compare
from mixprec.numerics.verdict import (
    CHAOS_PERTURBATION,
    Floor,
    judge,
    loss_grid,
    rounding_sqnr_db,
    unresolved_loss,
)
from mixprec.policy import POLICIES

EXAMPLE = Path(__file__).parents[2] / "examples" / "planted_outlier.py"
CHAOS_IN = 20 * math.log10(1 / CHAOS_PERTURBATION)  # a 2^-20 perturbation: 120 dB


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def _trajectory(losses: list[float], output: torch.Tensor) -> Trajectory:
    grads = {"w": output.sum(dim=0)}
    return Trajectory(
        "t", losses=losses, stepped=[True] * len(losses), first_output=output, first_grads=grads
    )


def _judge(policy: str, ref: Trajectory, cand: Trajectory, floor: Floor) -> tuple[bool, str]:
    spec = POLICIES[policy]
    return judge(compare(ref, cand), cand, spec.thresholds, len(ref.losses), floor, spec.rounding_format)


def test_noise_fails_on_a_model_that_does_not_amplify_the_rounding():
    """nvfp4's rounding (17 dB) is less than the 20 dB margin: the floor went below 0 dB on a model
    that amplifies a perturbation by 2.5 dB, and an output unrelated to fp32's (-0.0 dB) passed."""
    out = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    losses = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3]
    ref = _trajectory(losses, out)
    cand = _trajectory(losses, noise)  # same losses: only the SQNR can tell
    calm = Floor(0.0, CHAOS_IN - 2.5, CHAOS_IN - 2.5)
    assert rounding_sqnr_db(POLICIES["nvfp4"].rounding_format) < 20  # why the floor went under 0 dB
    passed, reason = _judge("nvfp4", ref, cand, calm)
    assert not passed and "noise" in reason and reason.startswith("output SQNR")
    assert calm.required(3.0, calm.output_sqnr_db, POLICIES["nvfp4"].rounding_format) == 0.0


def test_a_chaotic_model_may_still_pass_below_0_db():
    """ResNet-50 at initialisation loses 91 dB of a 2^-20 weight perturbation by its gradients: bf16's
    53 dB rounding is noise there for any format, so its -2.3 dB gradient SQNR is not the format's
    failure (docs/check.md's calibration; the loss judges it)."""
    out = torch.randn(8, 10, generator=torch.Generator().manual_seed(0))
    ref = _trajectory([6.9, 6.8, 6.9, 6.7, 6.8, 6.6, 6.7, 6.5], out)
    cand = _trajectory([6.9, 6.81, 6.88, 6.72, 6.79, 6.62, 6.71, 6.52], out * 1.0001)
    cand.first_grads = {"w": -ref.first_grads["w"] * 0.3 + torch.randn(10) * ref.first_grads["w"].norm()}
    chaotic = Floor(0.04, 74.7, 29.7)
    cmp = compare(ref, cand)
    assert cmp.total_grad_sqnr_db is not None and cmp.total_grad_sqnr_db < 0
    passed, reason = _judge("bf16-mixed", ref, cand, chaotic)
    assert passed, reason


def test_a_constant_in_the_loss_changes_no_verdict():
    """A format whose output is noise: its loss differs from fp32's by 76%; with 1000 added to both
    losses the relative difference fell to 0.87% and it passed."""
    out = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    ref = [11.6, 9.8, 8.9, 7.7, 7.3, 7.0, 5.3, 7.2]
    cand = [2.79, 2.77, 2.76, 2.77, 2.77, 2.76, 2.77, 2.77]
    floor = Floor(0.0)  # no SQNR floors: the loss alone
    verdicts = []
    for offset in (0.0, 1000.0):
        shifted = [_trajectory([v + offset for v in ref], out), _trajectory([v + offset for v in cand], out)]
        verdicts.append(_judge("nvfp4", *shifted, floor))
    assert [passed for passed, _ in verdicts] == [False, False], verdicts
    assert "140% of the 6.3 that fp32's loss moved" in verdicts[1][1]


def _planted_outlier_plus_1000() -> mixprec.Workload:
    spec = importlib.util.spec_from_file_location("planted_outlier", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    workload = module.workload()
    own = workload.loss_fn
    workload.loss_fn = lambda model, batch: own(model, batch) + 1000.0  # no gradient changes
    return workload


def test_check_fails_the_format_that_turns_a_layer_into_noise_under_a_constant_loss_offset():
    """The reported run: examples/planted_outlier.py with 1000 added to the loss, nvfp4 passed
    ("output SQNR -0.0 dB (>= -5.7), gradient SQNR 0.0 dB (>= -5.2), max loss diff 0.87%")."""
    result = mixprec.check(_planted_outlier_plus_1000(), policies=["nvfp4"], steps=8, device="cpu")
    (verdict,) = result.candidates
    assert verdict.verdict == "fail", verdict.reason
    assert "that fp32's loss moved" in verdict.reason
    assert verdict.required_output_sqnr_db is not None and verdict.required_output_sqnr_db >= 0.0


# fp32's and bf16-true's losses on the nanoGPT fed random tokens (AMX Xeon, issue 53): fp32's falls
# 0.028 (from its start to the uniform guess's loss); bf16-true's loss is computed in bf16 and read on
# its grid, 0.0625 apart at 10.9, 0.119 off at the first step, before any update
FP32_LOSSES = [
    10.881102561950684,
    10.874594688415527,
    10.877488136291504,
    10.86823558807373,
    10.873324394226074,
    10.853529930114746,
]
BF16_LOSSES = [11.0, 10.9375, 10.875, 10.875, 10.875, 10.875]


def test_a_loss_read_on_a_half_formats_grid_coarser_than_fp32s_movement_cannot_fail_the_candidate():
    output = torch.linspace(1, 2, 8).reshape(2, 4)
    ref, cand = _trajectory(FP32_LOSSES, output), _trajectory(BF16_LOSSES, output * (1 + 1e-3))
    assert loss_grid(BF16_LOSSES) == ("bf16", 0.0625) and loss_grid(FP32_LOSSES) is None
    passed, reason = _judge("bf16-true", ref, cand, Floor(1e-5))
    assert passed, reason  # (the caller makes it inconclusive: unresolved_loss says why)
    why = unresolved_loss(BF16_LOSSES, compare(ref, cand).loss_range)
    assert why.startswith("its loss is computed in bf16, whose readings are 0.0625 apart")


def test_a_loss_on_a_half_formats_grid_is_still_judged_where_fp32s_moved_many_of_its_steps():
    """Where fp32's loss moves many of the grid's steps (the zoo GPT on learnable tokens), a
    candidate that lags it still fails: bf16-true's lost updates."""
    output = torch.linspace(1, 2, 8).reshape(2, 4)
    falling = [10.875 - 0.1 * t for t in range(6)]  # 0.5 over the steps: 8 of bf16's 0.0625
    lagging = [10.875 - 0.0625 * (t // 2) for t in range(6)]  # on bf16's grid, at a third of the pace
    ref, cand = _trajectory(falling, output), _trajectory(lagging, output * (1 + 1e-3))
    assert loss_grid(lagging) == ("bf16", 0.0625)
    assert not unresolved_loss(lagging, compare(ref, cand).loss_range)
    passed, reason = _judge("bf16-true", ref, cand, Floor(1e-5))
    assert not passed and "that fp32's loss moved over the checked steps" in reason
