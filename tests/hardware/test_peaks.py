"""Peak FLOP/s table, CPU peak measurement and caching, FLOP counting and MFU."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
import torch

from mixprec.errors import CacheWarning, UsageError
from mixprec.frameworks.torch.flops import count_flops
from mixprec.hardware import peaks
from mixprec.hardware.device import DeviceInfo
from mixprec.hardware.peaks import (
    DTYPE_KEYS,
    GPU_PEAKS,
    cpu_peak,
    find_gpu_entry,
    gpu_peak,
    measure_cpu_peak,
    peak_flops,
)
from mixprec.measure.mfu import achieved_tflops, mfu
from mixprec.policy import POLICY_NAMES, spec_of

FAKE_CPU = DeviceInfo(type="cpu", name="Fake CPU 9000", cpu_flags=frozenset({"avx2", "avx512f"}))


def _by_model() -> dict[str, dict[str, float]]:
    models: dict[str, dict[str, float]] = defaultdict(dict)
    for entry in GPU_PEAKS:
        models[entry.device_pattern][entry.dtype_key] = entry.tflops
    return models


# ----------------------------------------------------------------------------- table sanity


def test_every_entry_is_well_formed():
    seen = set()
    for entry in GPU_PEAKS:
        assert entry.tflops > 0, entry
        assert entry.source.strip(), entry
        assert entry.dtype_key in DTYPE_KEYS, entry
        re.compile(entry.device_pattern)
        assert (entry.device_pattern, entry.dtype_key) not in seen, f"duplicate {entry}"
        seen.add((entry.device_pattern, entry.dtype_key))


def test_dtype_ordering_per_gpu():
    for pattern, peaks_ in _by_model().items():
        assert "fp32" in peaks_, pattern
        if "tf32" in peaks_:
            assert peaks_["fp32"] <= peaks_["tf32"], pattern
            if "bf16" in peaks_:
                assert peaks_["tf32"] <= peaks_["bf16"], pattern
        if "bf16" in peaks_ and "fp16" in peaks_:
            assert peaks_["bf16"] == peaks_["fp16"], pattern
        if "fp8" in peaks_:
            assert peaks_["fp8"] >= peaks_["fp16"], pattern
        assert peaks_.get("fp16", peaks_["fp32"]) >= peaks_["fp32"], pattern


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA GH200 480GB"])
def test_h200_and_gh200_have_h100_sxm_compute(name):
    for key in DTYPE_KEYS:
        h100 = gpu_peak("NVIDIA H100 80GB HBM3", key)
        other = gpu_peak(name, key)
        if key == "fp4":  # Blackwell's: no Hopper has fp4 tensor cores
            assert h100 is None and other is None
            continue
        assert h100 is not None and other is not None
        assert other[0] == h100[0]


@pytest.mark.parametrize(
    ("name", "fp32_tflops", "source_word"),
    [
        ("NVIDIA H100 80GB HBM3", 67.0, "SXM5"),
        ("NVIDIA H100 PCIe", 51.0, "PCIe"),
        ("NVIDIA H100 NVL", 60.0, "H100 NVL"),
        ("NVIDIA H200", 67.0, "H200 SXM"),
        ("NVIDIA H200 NVL", 60.0, "H200 NVL"),
        ("NVIDIA GH200 480GB", 67.0, "GH200"),
        ("NVIDIA B200", 75.0, "B200"),
        ("NVIDIA A100-SXM4-80GB", 19.5, "SXM"),
        ("NVIDIA A100-SXM4-40GB", 19.5, "SXM"),
        ("NVIDIA A100-PCIE-40GB", 19.5, "PCIe"),
        ("NVIDIA A100 80GB PCIe", 19.5, "PCIe"),
        ("NVIDIA A10", 31.2, "A10 Tensor"),
        ("NVIDIA A10G", 31.52, "A10G"),
        ("NVIDIA L4", 30.3, "L4 Tensor"),
        ("NVIDIA L40", 90.5, "L40 GPU"),
        ("NVIDIA L40S", 91.6, "L40S"),
        ("Tesla V100-SXM2-16GB", 15.7, "SXM2"),
        ("Tesla V100-SXM2-32GB", 15.7, "SXM2"),
        ("Tesla V100-PCIE-16GB", 14.0, "PCIe"),
        ("Tesla V100S-PCIE-32GB", 16.4, "V100S"),
        ("Tesla T4", 8.1, "T4"),
        ("NVIDIA GeForce RTX 4090", 82.6, "RTX 4090"),
        ("NVIDIA GeForce RTX 3090", 35.6, "RTX 3090"),
    ],
)
def test_most_specific_pattern_wins(name, fp32_tflops, source_word):
    entry = find_gpu_entry(name, "fp32")
    assert entry is not None, name
    assert entry.tflops == fp32_tflops
    assert source_word in entry.source
    found = gpu_peak(name, "fp32")
    assert found == (fp32_tflops * 1e12, entry.source)


def test_headline_numbers():
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "tf32")[0] == 156e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "bf16")[0] == 312e12
    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == pytest.approx(989.4e12)
    assert gpu_peak("NVIDIA H100 80GB HBM3", "fp8")[0] == pytest.approx(1978.9e12)
    assert gpu_peak("Tesla V100-SXM2-16GB", "fp16")[0] == 125e12
    assert gpu_peak("NVIDIA L4", "fp8")[0] == pytest.approx(242.5e12)
    assert gpu_peak("NVIDIA L40S", "bf16")[0] == 362e12
    assert "dense" in gpu_peak("NVIDIA L40S", "bf16")[1]


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "NVIDIA GeForce RTX 3090 Ti",
        "NVIDIA GeForce GTX 1080",
        "AMD Instinct MI300X",
        "",
    ],
)
def test_unknown_gpu_is_none(name):
    for key in DTYPE_KEYS:
        assert gpu_peak(name, key) is None


def test_missing_dtype_is_none_not_another_model():
    assert gpu_peak("Tesla V100-SXM2-16GB", "bf16") is None
    assert gpu_peak("Tesla V100-SXM2-16GB", "tf32") is None
    assert gpu_peak("Tesla T4", "tf32") is None
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp8") is None


# ----------------------------------------------------------------------------- policies


def test_every_policy_names_a_peak_key_the_tables_know():
    expected = {
        "fp32": "fp32",
        "tf32": "tf32",
        "bf32": "bf16",
        "bf16-mixed": "bf16",
        "bf16-true": "bf16",
        "fp16-mixed": "fp16",
        "fp16-true": "fp16",
        "fp8-rowwise": "fp8",
        "fp8-tensorwise": "fp8",
        "mxfp8": "fp8",
        "nvfp4": "fp4",
    }
    assert {name: spec_of(name).peak_key for name in POLICY_NAMES} == expected
    assert spec_of("16-mixed").peak_key == "fp16"  # aliases too
    assert set(expected.values()) <= set(DTYPE_KEYS)
    with pytest.raises(UsageError):
        peak_flops(DeviceInfo(type="cuda", name="NVIDIA H100 80GB HBM3"), "fp12")


def test_peak_flops_cuda():
    h100 = DeviceInfo(type="cuda", name="NVIDIA H100 80GB HBM3", index=0, capability=(9, 0))
    value, source = peak_flops(h100, "bf16")
    assert value == pytest.approx(989.4e12)
    assert "H100" in source
    assert peak_flops(h100, "fp32")[0] == 67e12
    assert peak_flops(h100, "tf32")[0] == pytest.approx(494.7e12)

    mystery = DeviceInfo(type="cuda", name="NVIDIA Mystery X1", index=0, capability=(12, 0))
    assert peak_flops(mystery, "fp16") == (None, "no datasheet entry for NVIDIA Mystery X1 fp16")
    v100 = DeviceInfo(type="cuda", name="Tesla V100-SXM2-16GB", index=0, capability=(7, 0))
    for name in POLICY_NAMES:  # never raises, even for dtypes the GPU lacks
        value, source = peak_flops(v100, spec_of(name).peak_key)
        assert value is None or value > 0
        assert source


# ----------------------------------------------------------------------------- CPU peaks


@pytest.fixture
def fake_measure(monkeypatch):
    calls: list[str] = []

    def fake(dtype_key, *, size=2048, repeats=5):
        calls.append(dtype_key)
        return {"fp32": 1.0e11, "bf16": 2.0e11, "fp16": 1.0e9}[dtype_key]

    monkeypatch.setattr(peaks, "measure_cpu_peak", fake)
    return calls


def test_cpu_peak_is_cached(tmp_path, fake_measure):
    first = cpu_peak("fp32", FAKE_CPU, cache_dir=tmp_path)
    assert first[0] == 1.0e11
    assert "fp32 matmul" in first[1] and str(tmp_path / "cpu_peaks.json") in first[1]
    assert f"{torch.get_num_threads()} thread" in first[1]
    second = cpu_peak("fp32", FAKE_CPU, cache_dir=tmp_path)
    assert second == first
    assert fake_measure == ["fp32"]
    # tf32 does not exist on CPU: it shares the fp32 measurement.
    assert cpu_peak("tf32", FAKE_CPU, cache_dir=tmp_path)[0] == 1.0e11
    assert fake_measure == ["fp32"]
    assert cpu_peak("bf16", FAKE_CPU, cache_dir=tmp_path)[0] == 2.0e11
    assert fake_measure == ["fp32", "bf16"]
    data = json.loads((tmp_path / "cpu_peaks.json").read_text())
    assert len(data["entries"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["cpu_peaks.json"]  # no temp files left behind


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        "[1, 2]",
        '{"entries": []}',
        json.dumps({"entries": {"x": {"flops": -1, "source": "s"}}}),
        "\xff\xfe",
    ],
)
def test_corrupt_cache_is_ignored_and_rewritten(tmp_path, fake_measure, content):
    path = tmp_path / "cpu_peaks.json"
    path.write_text(content, encoding="latin-1")
    with pytest.warns(CacheWarning, match="cpu_peaks.json"):  # a miss, said in one line
        assert cpu_peak("fp32", FAKE_CPU, cache_dir=tmp_path)[0] == 1.0e11
    assert fake_measure == ["fp32"]
    data = json.loads(path.read_text())
    assert len(data["entries"]) == 1
    assert cpu_peak("fp32", FAKE_CPU, cache_dir=tmp_path)[0] == 1.0e11
    assert fake_measure == ["fp32"]


def test_cache_key_includes_threads_flags_and_name(tmp_path, fake_measure, monkeypatch):
    cpu_peak("fp32", FAKE_CPU, cache_dir=tmp_path)
    monkeypatch.setattr(peaks.torch, "get_num_threads", lambda: 77)
    cpu_peak("fp32", FAKE_CPU, cache_dir=tmp_path)
    assert fake_measure == ["fp32", "fp32"]
    other_flags = DeviceInfo(type="cpu", name=FAKE_CPU.name, cpu_flags=frozenset({"amx_bf16"}))
    cpu_peak("fp32", other_flags, cache_dir=tmp_path)
    other_name = DeviceInfo(type="cpu", name="Another CPU", cpu_flags=FAKE_CPU.cpu_flags)
    cpu_peak("fp32", other_name, cache_dir=tmp_path)
    assert len(fake_measure) == 4
    cpu_peak("fp32", other_name, cache_dir=tmp_path)
    assert len(fake_measure) == 4
    assert len(json.loads((tmp_path / "cpu_peaks.json").read_text())["entries"]) == 4


def test_cache_dir_from_environment(tmp_path, fake_measure, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path / "env-cache"))
    value, source = cpu_peak("bf16", FAKE_CPU)
    assert value == 2.0e11
    assert (tmp_path / "env-cache" / "cpu_peaks.json").is_file()
    assert str(tmp_path / "env-cache") in source


def test_peak_flops_cpu_never_raises(tmp_path, fake_measure):
    for name in POLICY_NAMES:
        value, source = peak_flops(FAKE_CPU, spec_of(name).peak_key, cache_dir=tmp_path)
        key = spec_of(name).peak_key
        if key in ("fp8", "fp4"):  # no fp8 or fp4 matmul on a CPU: no peak, and it says so
            assert value is None and source == f"no CPU {key} matmul to measure"
            continue
        assert value is not None and value > 0
        assert source.startswith("measured:")
    assert sorted(fake_measure) == ["bf16", "fp16", "fp32"]  # one measurement per dtype


def test_peak_flops_cpu_reports_failed_measurement(tmp_path, monkeypatch):
    def broken(dtype_key, *, size=2048, repeats=5):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(peaks, "measure_cpu_peak", broken)
    value, source = peak_flops(FAKE_CPU, "fp16", cache_dir=tmp_path)
    assert value is None
    assert "no kernel" in source


def test_real_cpu_measurement():
    flops = measure_cpu_peak("fp32", size=256, repeats=2)
    assert flops > 1e8


def test_real_cpu_measurement_bf16_and_invalid():
    assert measure_cpu_peak("bf16", size=128, repeats=1) > 1e6
    with pytest.raises(ValueError):
        measure_cpu_peak("fp8", size=64, repeats=1)


def test_measurement_runs_strict_fp32_inside_bf32(monkeypatch):
    from mixprec.state import PrecisionSettings, effective_state, precision_settings

    seen: list[object] = []
    real_once = peaks._once

    def spy(a, b):
        seen.append(effective_state()["mkldnn.matmul"])
        return real_once(a, b)

    monkeypatch.setattr(peaks, "_once", spy)
    with precision_settings(PrecisionSettings(mkldnn="bf16")):
        before = effective_state()
        measure_cpu_peak("fp32", size=128, repeats=1)
        assert effective_state() == before  # the outer setting is restored afterwards
    assert seen and set(seen) == {"ieee"}


# ----------------------------------------------------------------------------- FLOP counting and MFU


def test_count_flops_linear_forward_and_backward():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    forward = 2 * 8 * 64 * 32
    assert count_flops(lambda: layer(x)) == forward
    # Backward of a Linear: grad of the weight (1x), plus grad of the input (1x) when it needs one.
    assert count_flops(lambda: layer(x).sum().backward()) == 2 * forward
    x.requires_grad_(True)
    assert count_flops(lambda: layer(x).sum().backward()) == 3 * forward


def test_count_flops_without_matmuls_is_zero():
    assert count_flops(lambda: torch.ones(4) + 1) == 0


def test_mfu_and_achieved_tflops():
    assert mfu(1e12, 0.5, 4e12) == pytest.approx(0.5)
    assert achieved_tflops(2e12, 2.0) == pytest.approx(1.0)
    assert achieved_tflops(32768, 1e-6) == pytest.approx(32768 / 1e-6 / 1e12)
    for args in [(None, 1.0, 1e12), (1e12, None, 1e12), (1e12, 1.0, None), (0, 1.0, 1e12), (1e12, 0.0, 1e12)]:
        assert mfu(*args) is None
    assert mfu(1e12, 1.0, 0.0) is None
    assert achieved_tflops(None, 1.0) is None
    assert achieved_tflops(1e12, None) is None
    assert achieved_tflops(0, 1.0) is None
    assert achieved_tflops(1e12, 0.0) is None
