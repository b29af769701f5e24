"""A prediction is priced at what its emulation costs here, timed before its check (issue 53, found
on the 2-core AMX Xeon): fp8 through torchao's recipe ran 600-2000x strict fp32's time there
(oneDNN's reference matmul), and the nanoGPT tune, pricing its fp8 prediction at fp32's step, spent
over 20 minutes of a 300 s budget in it. On planted step times and the planted clock: the budget
pays for planted work only."""

from __future__ import annotations

from typing import ClassVar

import pytest

import mixprec
from mixprec.frameworks import register_framework, unregister_framework
from mixprec.frameworks.torch.emulation_cost import emulation_slowdown
from mixprec.policy import Candidate

from .scripted import CLOCK, Planted, PlantedFramework, planted_clock  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("planted_clock")

FP32_S = 0.2
BUDGET_S = 120


class Emulating(PlantedFramework):
    """fp8-rowwise cannot run here but its numerics can be computed, ``slowdown`` times strict
    fp32's step: every planted run of it costs that."""

    slowdown = 1000.0
    timed: ClassVar[list[Candidate]] = []

    def predictable(self, candidate, info, workload=None):
        return "predicted on a planted device" if candidate.policy == "fp8-rowwise" else None

    def predictions(self, workload, info, affordable=None, policies=()):
        return [Candidate("fp8-rowwise", framework=self.name)], []

    def emulation_slowdown(self, candidate, device):
        type(self).timed.append(candidate)
        return self.slowdown

    def trajectory(self, workload, candidate, batches, steps, device, *, perturb=0.0):
        if candidate.policy == "fp8-rowwise":
            CLOCK.spend(steps * FP32_S * (self.slowdown - 1))  # the rest: the planted fp32 step below
        return super().trajectory(workload, candidate, batches, steps, device, perturb=perturb)


@pytest.fixture
def emulating():
    framework = Emulating()
    Emulating.timed = []
    register_framework(framework)
    yield framework
    unregister_framework("planted")


def _tune() -> tuple[mixprec.TuneResult, float]:
    started = CLOCK.seconds
    result = mixprec.tune(
        Planted({"fp32": FP32_S, "bf16-mixed": FP32_S / 2}),
        budget_s=BUDGET_S,
        steps=4,
        warmup=1,
        check_steps=4,
        compile_modes=(),
        optimizers=False,
    )
    return result, CLOCK.seconds - started


def test_an_emulation_far_slower_than_fp32_is_not_run_past_the_budget_and_says_why(emulating):
    result, spent = _tune()
    assert spent <= BUDGET_S, f"the tune's planted work took {spent:.0f} s of a {BUDGET_S} s budget"
    said = "fp8-rowwise numerics not predicted: its emulation here runs 1,000x strict fp32's time"
    assert any(n.startswith(said) for n in result.notes), result.notes
    # timed once, however often it was priced
    assert Emulating.timed == [Candidate("fp8-rowwise", framework="planted")]
    rec = result.recommendation
    assert rec is not None and rec.candidate.policy == "bf16-mixed"


def test_an_emulation_at_fp32s_pace_is_still_predicted(emulating):
    emulating.slowdown = 1.0
    result, spent = _tune()
    assert any(n.startswith("fp8-rowwise would pass the numerics check") for n in result.notes), result.notes
    assert spent <= BUDGET_S


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "mxfp8"])
def test_the_torch_probe_times_one_layer_and_never_prices_below_fp32(policy):
    """(No figure asserted: a ratio of two timings is this machine's; only what it may be.)"""
    slowdown = emulation_slowdown(Candidate(policy), "cpu")
    assert isinstance(slowdown, float) and slowdown >= 1.0
