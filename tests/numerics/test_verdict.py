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
from mixprec.numerics.verdict import CHAOS_PERTURBATION, Floor, judge, rounding_sqnr_db
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
