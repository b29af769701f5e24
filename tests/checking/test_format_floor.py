"""A half format's loss is judged against fp32 runs its own rounding apart (issue 38): on a chaotic
model a 2^-20 chaos run can still be short of saturation where one of bf16's size has saturated,
and the tiny floor alone failed healthy bf16 (the default `mixprec tune`, ResNet-50 from scratch:
bf16-mixed 10.2% apart, allowed 6.2%). On planted trajectories whose divergence grows 8x a step
from the runs' perturbation, so the verdict's arithmetic is all that runs."""

from __future__ import annotations

import pytest
from tests.tuning.scripted import Planted, PlantedFramework, planted_clock  # noqa: F401 (a fixture)

import mixprec
from mixprec.frameworks import register_framework, unregister_framework
from mixprec.numerics.verdict import format_perturbation
from mixprec.status import Status

BF16_ROUNDING = 2.0**-8
SATURATED = 0.3  # how far apart two runs of this model end up, whatever started them apart

pytestmark = pytest.mark.usefixtures("planted_clock")


class Chaotic(PlantedFramework):
    """Loss 1 - 0.1 t (it learns); a run started ``e`` apart lies min(0.3, e 8^t) above it. A
    candidate in bf16 starts one bf16 rounding apart and adds ``bias`` (a format that hurts)."""

    bias = 0.0

    def trajectory(self, workload, candidate, batches, steps, device, *, perturb=0.0):
        traj = super().trajectory(workload, candidate, batches, steps, device, perturb=perturb)
        e = perturb if candidate.policy == "fp32" else BF16_ROUNDING
        extra = 0.0 if candidate.policy == "fp32" else self.bias
        traj.losses = [(1 - 0.1 * t) * (1 + min(SATURATED, e * 8.0**t) + extra) for t in range(steps)]
        return traj


@pytest.fixture
def chaotic():
    framework = Chaotic()
    register_framework(framework)
    yield framework
    unregister_framework("planted")


def _check(steps: int = 6):
    planted = Planted({"fp32": 0.2, "bf16-mixed": 0.1})
    Chaotic().tune_candidates(planted, None)  # what the planted device supports
    return mixprec.check(planted, policies=["bf16-mixed"], steps=steps)


def test_healthy_bf16_on_a_chaotic_model_is_within_its_own_rounding_randomness(chaotic):
    (cand,) = _check().candidates
    # the 2^-20 run: 2^-20 8^5 = 3.1% at step 5; bf16's: saturated at 30% from step 3, as the candidate
    assert cand.verdict == Status.PASS, cand.reason
    assert cand.max_rel_loss_diff == pytest.approx(SATURATED, rel=1e-6)
    assert "within training randomness" in cand.reason and "one bf16 rounding" in cand.reason


def test_a_bf16_run_further_off_than_its_rounding_explains_still_fails(chaotic):
    chaotic.bias = 1.0  # every loss doubled on top of the chaos: a format that breaks training
    (cand,) = _check().candidates
    assert cand.verdict == Status.FAIL
    assert "whose weights differ by one bf16 rounding drift" in cand.reason


def test_only_the_formats_whose_rounding_is_randomness_get_a_run_of_their_own():
    assert format_perturbation("bf16") == 2.0**-8 and format_perturbation("fp16") == 2.0**-11
    assert format_perturbation("tf32") == 2.0**-11
    for fmt in ("fp32", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"):
        assert format_perturbation(fmt) is None  # fp8/fp4 weights rounded once are another model
