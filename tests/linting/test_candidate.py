"""Lint judges a Candidate whole: a channels_last pick is not told its model runs NCHW (tune once
linted the policy name only, and the committed ResNet-50 tune said MP201 under bf16-mixed+cl)."""

from __future__ import annotations

import pytest

import mixprec
from mixprec.frameworks import framework_named
from mixprec.policy import Candidate


@pytest.fixture(scope="module")
def resnet():
    return mixprec.load_workload("resnet50", image_size=64)


def rules(findings) -> set[str]:
    return {f["rule"] if isinstance(f, dict) else f.rule for f in findings}


def test_a_channels_last_candidate_gets_no_nchw_finding(resnet):
    assert "MP201" in rules(mixprec.lint(resnet, Candidate("bf16-mixed")))
    assert "MP201" not in rules(mixprec.lint(resnet, Candidate("bf16-mixed", channels_last=True)))


def test_tune_lints_its_pick_through_the_backend_whole(resnet):
    torch_backend = framework_named("torch")
    picked = torch_backend.lint(resnet, Candidate("bf16-mixed", channels_last=True), "cpu")
    assert picked is not None and "MP201" not in rules(picked)
    assert "MP201" in rules(torch_backend.lint(resnet, Candidate("bf16-mixed"), "cpu") or [])


def test_a_candidate_and_a_separate_channels_last_is_one_setting_too_many(resnet):
    with pytest.raises(mixprec.UsageError, match="channels_last was given both"):
        mixprec.lint(resnet, Candidate("bf16-mixed", channels_last=True), channels_last=False)
