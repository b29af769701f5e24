"""Support gating against fake device capabilities (no GPU needed) and against this machine's CPU."""

from __future__ import annotations

import itertools

import pytest

import mixprec
from mixprec import DeviceInfo
from mixprec.policy.fp8 import torchao_available

ALL = set(mixprec.POLICY_NAMES)
HALF = {"bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"}
# fp8 runs through torchao (the fp8 extra, installed by `make test`)
FP8 = {"fp8-rowwise", "fp8-tensorwise"} if torchao_available() else set()

DEVICES = {
    "P100": DeviceInfo(type="cuda", name="P100", capability=(6, 0)),
    "V100": DeviceInfo(type="cuda", name="V100", capability=(7, 0)),
    "T4": DeviceInfo(type="cuda", name="T4", capability=(7, 5)),
    "A100": DeviceInfo(type="cuda", name="A100", capability=(8, 0)),
    "L4": DeviceInfo(type="cuda", name="L4", capability=(8, 9)),
    "H100": DeviceInfo(type="cuda", name="H100", capability=(9, 0)),
    "cpu-avx512bf16": DeviceInfo(type="cpu", name="cpu", cpu_flags=frozenset({"avx512_bf16"})),
    "cpu-amx": DeviceInfo(type="cpu", name="cpu", cpu_flags=frozenset({"amx_bf16", "amx_fp16"})),
    "cpu-avx512fp16": DeviceInfo(type="cpu", name="cpu", cpu_flags=frozenset({"avx512_fp16"})),
    "cpu-plain": DeviceInfo(type="cpu", name="cpu", cpu_flags=frozenset()),
}

SUPPORTED = {
    "P100": {"fp32"},
    "V100": {"fp32", "fp16-mixed", "fp16-true"},
    "T4": {"fp32", "fp16-mixed", "fp16-true"},
    "A100": {"fp32", "tf32", *HALF},
    "L4": {"fp32", "tf32", *HALF, *FP8},
    "H100": {"fp32", "tf32", *HALF, *FP8},
    "cpu-avx512bf16": {"fp32", "bf32", *HALF},
    "cpu-amx": {"fp32", "bf32", *HALF},
    "cpu-avx512fp16": {"fp32", *HALF},
    "cpu-plain": {"fp32", *HALF},
}

# Supported, but the reason warns that it will be slow, and a faster policy is suggested.
SLOW = {
    ("cpu-plain", "bf16-mixed"): ("emulated", "fp32"),
    ("cpu-plain", "bf16-true"): ("emulated", "fp32"),
    ("cpu-plain", "fp16-mixed"): ("slow", "fp32"),
    ("cpu-avx512bf16", "fp16-mixed"): ("slow", "bf16-mixed"),
    ("cpu-avx512bf16", "fp16-true"): ("slow", "bf16-mixed"),
    ("cpu-avx512fp16", "bf16-mixed"): ("emulated", "fp16-mixed"),  # native fp16 beats emulated bf16
}

PAIRS = list(itertools.product(DEVICES, mixprec.POLICY_NAMES))


@pytest.mark.parametrize(("device", "name"), PAIRS)
def test_support_table(device, name):
    support = mixprec.check_support(name, DEVICES[device])
    assert isinstance(support, mixprec.Support)
    assert support.supported == (name in SUPPORTED[device])
    assert bool(support) == support.supported
    assert isinstance(support.reason, str) and support.reason.strip()
    if not support.supported:
        assert isinstance(support.suggestion, str) and support.suggestion.strip()
    if (device, name) in SLOW:
        word, suggestion = SLOW[(device, name)]
        assert word in support.reason
        assert support.suggestion == suggestion


@pytest.mark.parametrize("name", ["fp8-rowwise", "fp8-tensorwise"])
def test_fp8_needs_compute_capability_8_9_and_says_what_a_cpu_can_do(name):
    a100 = mixprec.check_support(name, DEVICES["A100"])
    assert not a100 and "compute capability >= 8.9, this GPU has compute capability 8.0" in a100.reason
    assert a100.suggestion == "bf16-mixed"
    cpu = mixprec.check_support(name, DEVICES["cpu-avx512bf16"])
    assert not cpu and "predicts its numerics here" in cpu.reason


@pytest.mark.parametrize("device", ["V100", "T4", "P100"])
def test_tf32_reason_names_the_capability(device):
    info = DEVICES[device]
    support = mixprec.check_support("tf32", info)
    assert not support
    assert f"{info.capability[0]}.{info.capability[1]}" in support.reason
    assert ">= 8.0" in support.reason


def test_tf32_on_cpu_explains_and_suggests_cpu_alternatives():
    support = mixprec.check_support("tf32", DEVICES["cpu-avx512bf16"])
    assert not support
    assert "CPU" in support.reason
    assert "bf32" in support.suggestion


@pytest.mark.parametrize("device", ["V100", "T4"])
@pytest.mark.parametrize(("name", "alternative"), [("bf16-mixed", "fp16-mixed"), ("bf16-true", "fp16-mixed")])
def test_emulated_bf16_gpu_suggests_fp16(device, name, alternative):
    support = mixprec.check_support(name, DEVICES[device])
    assert not support
    assert "emulated" in support.reason
    assert support.suggestion == alternative


@pytest.mark.parametrize("device", [d for d, info in DEVICES.items() if info.type == "cpu"])
def test_bf16_mixed_runs_on_every_cpu(device):
    info = DEVICES[device]
    support = mixprec.check_support("bf16-mixed", info)
    assert support
    assert ("emulated" in support.reason) == (not info.native_bf16)


def test_bf32_only_on_native_bf16_cpus():
    for device, info in DEVICES.items():
        expected = info.type == "cpu" and bool(info.cpu_flags & {"avx512_bf16", "amx_bf16"})
        assert bool(mixprec.check_support("bf32", info)) == expected, device
    assert mixprec.check_support("bf32", DEVICES["A100"]).suggestion == "tf32"


def test_bf32_needs_onednn():
    info = DeviceInfo(type="cpu", name="cpu", cpu_flags=frozenset({"avx512_bf16"}), mkldnn_available=False)
    support = mixprec.check_support("bf32", info)
    assert not support
    assert "oneDNN" in support.reason


@pytest.mark.parametrize(
    ("device", "native_bf16", "native_fp16", "tf32", "fp8"),
    [
        ("P100", False, False, False, False),
        ("V100", False, True, False, False),
        ("T4", False, True, False, False),
        ("A100", True, True, True, False),
        ("L4", True, True, True, True),
        ("H100", True, True, True, True),
        ("cpu-avx512bf16", True, False, False, False),
        ("cpu-amx", True, True, False, False),
        ("cpu-avx512fp16", False, True, False, False),
        ("cpu-plain", False, False, False, False),
    ],
)
def test_capability_flags(device, native_bf16, native_fp16, tf32, fp8):
    info = DEVICES[device]
    assert (info.native_bf16, info.native_fp16, info.tf32, info.fp8) == (native_bf16, native_fp16, tf32, fp8)
    d = info.to_dict()
    assert (d["native_bf16"], d["native_fp16"], d["tf32"], d["fp8"]) == (native_bf16, native_fp16, tf32, fp8)
    assert d["cpu_flags"] == sorted(info.cpu_flags)


def test_fp8_needs_exactly_8_9():
    assert not DeviceInfo(type="cuda", name="x", capability=(8, 6)).fp8
    assert DeviceInfo(type="cuda", name="x", capability=(8, 9)).fp8
    assert DeviceInfo(type="cuda", name="x", capability=(10, 0)).fp8
    assert not DeviceInfo(type="cpu", name="x", cpu_flags=frozenset({"amx_fp16"})).fp8


ODD_DEVICES = [
    DeviceInfo(type="cuda", name="unknown"),  # no capability
    DeviceInfo(type="cuda", name="old", capability=(3, 5)),
    DeviceInfo(type="cpu", name="no-onednn", mkldnn_available=False),
    DeviceInfo(type="mps", name="apple"),
]


@pytest.mark.parametrize("info", [*DEVICES.values(), *ODD_DEVICES], ids=lambda i: f"{i.type}-{i.name}")
def test_check_support_never_raises(info):
    for name in [*mixprec.POLICY_NAMES, "fp16", "bf16", "32-true", "16-mixed", "16-true"]:
        support = mixprec.check_support(name, info)
        assert isinstance(support.supported, bool)
        assert support.reason
        if not support:
            assert support.suggestion


def test_unknown_device_type_is_unsupported():
    for name in mixprec.POLICY_NAMES:
        support = mixprec.check_support(name, DeviceInfo(type="mps", name="apple"))
        assert not support
        assert "'mps'" in support.reason


@pytest.mark.parametrize("device", ["P100", "V100", "T4"])
def test_suggested_policy_is_supported_on_that_device(device):
    info = DEVICES[device]
    bad = []
    for name in mixprec.POLICY_NAMES:
        support = mixprec.check_support(name, info)
        suggestion = support.suggestion
        if not support and suggestion in mixprec.POLICY_NAMES and not mixprec.check_support(suggestion, info):
            bad.append(f"{name} -> {suggestion}")
    assert not bad, f"on {device}, unsupported suggestions: {bad}"


# ---------------------------------------------------------------------------------------- this machine
def test_real_cpu():
    info = mixprec.detect("cpu")
    assert info.type == "cpu"
    assert info.name
    assert info.capability is None
    assert not mixprec.check_support("tf32", info)
    assert mixprec.check_support("fp32", info)
    assert mixprec.check_support("bf16-mixed", info)
    assert mixprec.check_support("fp16-mixed", info)
    assert mixprec.detect("cpu") is info  # cached
    if not info.native_bf16:
        pytest.skip(
            f"this CPU has no AVX512-BF16/AMX ({sorted(info.cpu_flags)}); bf32 is expected unsupported"
        )
    assert mixprec.check_support("bf32", info)
    assert "avx512_bf16" in info.cpu_flags or "amx_bf16" in info.cpu_flags


def test_nvidia_tf32_override_zero_shows_in_the_effective_state(monkeypatch):
    """The driver libraries ignore TF32 requests under NVIDIA_TF32_OVERRIDE=0 (measured on an H100 in
    tests/test_gpu.py), so env must not report cuDNN's default TF32 as effective."""
    from mixprec import state

    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    with state.precision_settings(state.PrecisionSettings(cuda_matmul="tf32", cudnn="tf32", mkldnn="ieee")):
        assert state.effective_state()["cudnn.conv"] == "tf32"
        monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
        eff = state.effective_state()
    assert eff["cuda.matmul"] == eff["cudnn.conv"] == "ieee (NVIDIA_TF32_OVERRIDE=0)"
    assert eff["mkldnn.matmul"] == "ieee" and eff["NVIDIA_TF32_OVERRIDE"] == "0"
    assert not mixprec.check_support("tf32", DEVICES["H100"])


@pytest.mark.parametrize("problem", ["range", "precision"])
def test_cures_name_only_policies_this_device_supports(problem):
    """Issue 26: a failing bf16-true check on a CPU suggested tf32, which the same device marks
    unsupported, next to 'use the *-mixed policy'."""
    from mixprec.policy.registry import POLICIES
    from mixprec.policy.support import cures

    info = mixprec.detect("cpu")
    for name in POLICIES:
        for fmt in ("bf16", "fp16"):
            for other in cures(name, problem, info, fmt):
                assert mixprec.check_support(other, info).supported, (name, other)
    assert "tf32" not in cures("bf16-true", "precision", info, "bf16")  # no TF32 on a CPU
    assert cures("bf16-true", "precision", info, "bf16")[0] == "bf16-mixed"  # fp32 master weights first


def test_cures_name_no_format_the_device_only_emulates():
    """Issue 51: a failing bf16-mixed check advised 'try fp16' on an EPYC (AVX512-BF16, no
    AVX512-FP16), where fp16 autocast measured 0.05x fp32. With AVX512-FP16 it is advice."""
    from dataclasses import replace

    from mixprec.hardware.device import DeviceInfo
    from mixprec.policy.support import cures

    epyc = DeviceInfo("cpu", "AMD EPYC", cpu_flags=frozenset({"avx512_bf16", "avx512f"}))
    assert epyc.native_bf16 and not epyc.native_fp16
    assert "fp16-mixed" not in cures("bf16-mixed", "precision", epyc, "bf16")
    assert cures("bf16-mixed", "precision", epyc, "bf16") == []
    xeon = replace(
        epyc, name="Intel Xeon", cpu_flags=frozenset({"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"})
    )
    assert "fp16-mixed" in cures("bf16-mixed", "precision", xeon, "bf16")
