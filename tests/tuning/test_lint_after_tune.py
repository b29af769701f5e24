"""The lint findings tune lists under its pick: advice the tune did not already answer. A layout
change it measured on the pick is in the table, not advice (the real linter's findings on a real
CNN; the tune's rows on planted step times, tests/tuning/scripted.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import mixprec
from mixprec.budget import Budget
from mixprec.events import ignore
from mixprec.frameworks import framework_named, register_framework, unregister_framework
from mixprec.hardware.device import detect
from mixprec.policy import Candidate
from mixprec.tuning import search as search_module
from mixprec.tuning.config import TuneConfig
from mixprec.tuning.decide import Recommendation
from mixprec.tuning.search import Search, Sweeps, complete

from .scripted import Planted, PlantedFramework, planted_clock  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("planted_clock")


@pytest.fixture(scope="module")
def nchw_findings():
    """What the linter says of an NCHW ResNet-18 under bf16-mixed on this CPU: MP201, channels_last."""
    workload = mixprec.load_workload("torchvision:resnet18", image_size=32)
    findings = framework_named("torch").lint(workload, Candidate("bf16-mixed"), "cpu")
    assert any(f["rule"] == "MP201" for f in findings), findings
    return findings


@pytest.fixture
def search():
    framework = PlantedFramework()
    register_framework(framework)
    config = TuneConfig(budget_s=600, compile_modes=(), lint=False).with_fields(steps=4, warmup=1)
    sweeps = Sweeps(
        Planted({"fp32": 1.0, "bf16-mixed": 0.5}, jitter=0.0),
        framework,
        config,
        device="cpu",
        batch_size=8,
        budget=Budget(600, reserve_s=search_module.RESERVE_S),
        events=ignore,
    )
    yield Search.start(sweeps, detect("cpu"))
    unregister_framework("planted")


def pick(search: Search) -> Recommendation:
    search.check_faster()
    rec = search.decide()[0]
    assert rec is not None and rec.candidate.policy == "bf16-mixed" and not rec.candidate.channels_last
    return rec


def complete_with(search: Search, rec: Recommendation, findings: list[dict]):
    """``complete`` with the planted backend's lint answering ``findings`` (resnet18's, real)."""
    search.framework.lint = lambda workload, candidate, device: findings  # (this instance only)
    return complete(search, rec, lint=True)


def test_a_layout_the_tune_measured_on_its_pick_is_not_listed_as_advice(search, nchw_findings):
    """`make demo` beside two busy processes picked bf16-mixed over bf16-mixed+cl ("within
    measurement noise") and then listed "lint MP201: model runs NCHW ... channels_last" under it."""
    rec = pick(search)
    nchw = search.row(rec.candidate)
    assert nchw is not None
    search.add([replace(nchw, candidate=replace(rec.candidate, channels_last=True))])
    done, _ = complete_with(search, rec, nchw_findings)
    assert "MP201" not in {f["rule"] for f in done.lint_worth_fixing}


def test_a_layout_the_tune_did_not_measure_stays_advice(search, nchw_findings):
    rec = pick(search)
    done, _ = complete_with(search, rec, nchw_findings)
    assert "MP201" in {f["rule"] for f in done.lint_worth_fixing}


def test_a_lint_that_fails_is_a_note_and_the_pick_stands(search):
    """Lint is advice: its failure under the pick must not lose the recommendation."""
    rec = pick(search)

    def broken(workload, candidate, device):
        raise RuntimeError("the tracer met an op it does not know")

    search.framework.lint = broken
    done, findings = complete(search, rec, lint=True)
    assert done.candidate == rec.candidate and findings is None and done.lint_worth_fixing == []
    assert any(n.startswith("lint failed: RuntimeError: the tracer met") for n in search.notes), search.notes


def test_no_lint_asked_is_no_lint_run(search):
    rec = pick(search)
    search.framework.lint = lambda *args: pytest.fail("linted though tune was told not to")
    done, findings = complete(search, rec, lint=False)
    assert findings is None and done.candidate == rec.candidate
