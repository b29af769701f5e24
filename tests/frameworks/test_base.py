"""The Framework interface and the registry: the neutral defaults a new backend starts from, and
clear errors for what no backend owns."""

from __future__ import annotations

import pytest

from mixprec.errors import PolicyError, UsageError
from mixprec.frameworks import (
    Framework,
    framework_named,
    framework_names,
    framework_of,
    known_framework,
    register_framework,
)
from mixprec.policy import Candidate
from mixprec.workload import load_workload


class Bare(Framework):
    name = "bare"
    title = "Bare"
    workload_type = dict
    workload_name = "dict"


def test_the_built_in_backends_are_registered_and_found_by_workload():
    assert framework_names()[:2] == ("torch", "tensorflow")
    assert framework_of(load_workload("mlp")) is framework_named("torch")
    assert known_framework("nope") is None
    with pytest.raises(
        UsageError, match=r"Unknown framework 'torhc'; valid: torch, tensorflow.*Did you mean 'torch'"
    ):
        framework_named("torhc")
    with pytest.raises(UsageError, match=r"no workload mixprec can train; pass one of: mixprec\.Workload"):
        framework_of(3)
    with pytest.raises(UsageError, match=r"takes a mixprec\.frameworks\.Framework instance"):
        register_framework("torch")  # type: ignore[arg-type]


def test_a_backend_starts_with_no_axes_and_says_so_in_its_terms():
    bare = Bare()
    assert bare.baseline == Candidate("fp32", framework="bare")
    assert bare.candidate("bf16-mixed").framework == "bare"
    for axes, message in (
        ({"channels_last": True}, "channels_last does not apply to Bare candidates"),
        ({"compile": "default"}, "Unknown Bare compile mode 'default'; valid: none here"),
        ({"optimizer": "fused"}, "Bare has no optimizer implementation 'fused'; valid: none here"),
        ({"emulate": "bf16"}, "Bare candidates cannot emulate a format"),
    ):
        with pytest.raises(PolicyError, match=message):
            bare.candidate("fp32", **axes)
    with pytest.raises(PolicyError, match="is a torch candidate, not a bare one"):
        bare.validate(Candidate("fp32"))
    assert bare.lint({}, bare.baseline, "cpu") is None and bare.exports(bare.baseline, "cpu") == ({}, {})
    assert bare.bench_layouts({}, [False, True]) == ([False], None)
    with pytest.raises(NotImplementedError):
        bare.trajectory({}, bare.baseline, [], 1, "cpu")


def test_an_fp8_prediction_with_nothing_to_convert_says_why_in_good_grammar():
    """ResNet-50 has one Linear layer (the classifier, 1000 outputs, not a multiple of 16)."""
    import mixprec
    from mixprec.frameworks import framework_of
    from mixprec.hardware.device import detect

    workload = mixprec.load_workload("resnet50", image_size=32)
    _, notes = framework_of(workload).predictions(workload, detect("cpu"))  # MX/NV formats: always
    assert notes and all("(1 has a dimension its kernels cannot take)" in n for n in notes)
