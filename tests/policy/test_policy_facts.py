"""The per-policy facts on PolicySpec drive support suggestions, starting points and export
refusals: the behaviour pinned here is what the tables they replaced gave."""

from __future__ import annotations

import pytest
from test_support import DEVICES

import mixprec
from mixprec import DeviceInfo
from mixprec.exports import EXPORT_TARGETS, export_status
from mixprec.policy import POLICIES, PolicyConfig, starting_policy

STARTS = {
    "P100": "fp32",
    "V100": "fp16-mixed",
    "T4": "fp16-mixed",
    "A100": "bf16-mixed",
    "L4": "bf16-mixed",
    "H100": "bf16-mixed",
    "cpu-avx512bf16": "bf16-mixed",
    "cpu-amx": "bf16-mixed",
    "cpu-avx512fp16": "fp32",  # fp16-mixed is no CPU starting point, even with native fp16
    "cpu-plain": "fp32",
}


@pytest.mark.parametrize("device", DEVICES)
def test_starting_policy_per_device(device):
    assert starting_policy(DEVICES[device]) == STARTS[device]


def test_an_unknown_device_type_starts_in_fp32():
    assert starting_policy(DeviceInfo(type="mps", name="mps")) == "fp32"


@pytest.mark.parametrize("device", DEVICES)
def test_a_suggestion_is_the_first_native_fallback(device):
    info = DEVICES[device]
    for name in mixprec.POLICY_NAMES:
        support = mixprec.check_support(name, info)
        if support.native:
            continue
        native = [alt for alt in POLICIES[name].fallbacks if mixprec.check_support(alt, info).native]
        assert support.suggestion == (native[0] if native else "fp32"), (device, name)


@pytest.mark.parametrize("name", [n for n, s in POLICIES.items() if s.device_only is not None])
def test_a_device_only_policy_is_refused_elsewhere_with_its_spec_words(name):
    only = POLICIES[name].device_only
    assert only is not None
    other = next(d for d in ("cpu", "cuda") if d != only.device_type)
    for target in EXPORT_TARGETS:
        faithful, reason = export_status(PolicyConfig(name, other), target)
        assert not faithful and reason == f"{only.reason}; instead: {only.alternative}", target
