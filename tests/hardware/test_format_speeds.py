"""'Native' means measured: a format whose kernels are slow here is called slow (issue 42: a Xeon
with AVX512-FP16 whose fp16 convolutions took ~35x fp32's time was called "native fp16")."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch

from mixprec.cli import main
from mixprec.errors import UsageError
from mixprec.hardware import formats
from mixprec.hardware.device import detect
from mixprec.hardware.formats import FormatSpeed, slow_formats

XEON_FP16 = FormatSpeed("fp16", matmul=1.6, conv=1 / 35, source="scripted")


def test_fast_matmuls_and_slow_convolutions_are_slow_for_a_cnn_only():
    assert XEON_FP16.slow(conv=False) is None  # a transformer: its matmuls are what runs
    why = XEON_FP16.slow(conv=True)
    assert why is not None and "convolutions run at 0.03x fp32's rate" in why and "matmuls" not in why
    assert XEON_FP16.rate(conv=True) == pytest.approx(1 / 35) and XEON_FP16.rate(conv=False) == 1.6


def test_check_and_train_are_warned_before_a_slow_format(monkeypatch):
    speeds = {"fp16": XEON_FP16, "bf16": FormatSpeed("bf16", 2.0, 2.1, "scripted")}
    monkeypatch.setattr(formats, "format_speed", lambda info, key, conv=True: speeds[key])
    policies = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "fp32"}
    warned = slow_formats(policies, detect("cpu"), conv=True)
    assert len(warned) == 1 and warned[0].startswith("fp16-mixed: fp16 is slow on this device")
    assert slow_formats(policies, detect("cpu"), conv=False) == []


def test_env_reports_the_measured_rates(tmp_path, capsys):
    assert main(["env", "--device", "cpu", "--json", str(tmp_path / "env.json")]) == 0
    env = json.loads((tmp_path / "env.json").read_text())["env"]
    for key in ("bf16", "fp16"):
        speed = env["format_speeds"][key]
        assert speed["matmul_vs_fp32"] > 0 and speed["conv_vs_fp32"] > 0
    assert "bf16 measured (vs fp32)" in capsys.readouterr().out


class _Neighbour:
    """A fake clock and probe: fp32's call costs 2 units, bf16's 1 (bf16 twice as fast), and a
    neighbour slows every call 4x while it runs (the first ``busy_calls`` calls)."""

    COST: ClassVar[dict[torch.dtype, float]] = {torch.float32: 2.0, torch.bfloat16: 1.0}

    def __init__(self, busy_calls: int) -> None:
        self.now, self.calls, self.busy_calls = 0.0, 0, busy_calls

    def clock(self) -> float:
        return self.now

    def probe(self, op: str, dtype: torch.dtype):
        def call() -> None:
            self.calls += 1
            self.now += self.COST[dtype] * (4.0 if self.calls <= self.busy_calls else 1.0)

        return call


def test_a_neighbour_that_comes_and_goes_does_not_change_the_measured_rate(monkeypatch):
    # issue 42: fp32's peak taken in a quiet minute and bf16's while a neighbour ran called a 2x
    # format 0.5x, i.e. slow, for good (the peaks were cached); alternating rounds see the load on both
    # sides of a round, and the median drops the round it straddles
    for busy_calls in (0, 7, 14, 1000):
        fake = _Neighbour(busy_calls)
        monkeypatch.setattr(formats.time, "perf_counter", fake.clock)
        assert formats.measure_format_ratio("bf16", "matmul", probe=fake.probe) == pytest.approx(2.0)


def test_format_rates_are_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    fake = _Neighbour(busy_calls=0)
    monkeypatch.setattr(formats.time, "perf_counter", fake.clock)
    monkeypatch.setattr(formats, "_probe", fake.probe)
    info = detect("cpu")
    first = formats.format_speed(info, "bf16", conv=True)
    assert first.matmul == pytest.approx(2.0) and first.conv == pytest.approx(2.0)
    measured = fake.calls
    again = formats.format_speed(info, "bf16", conv=True)
    assert (again.matmul, again.conv) == (first.matmul, first.conv) and fake.calls == measured
    assert (tmp_path / "format_rates.json").is_file()


def test_an_unknown_probe_is_refused_by_name():
    with pytest.raises(UsageError, match=r"'fp8'.*valid: dtypes fp32, tf32, bf16, fp16"):
        formats.measure_format_ratio("fp8", "matmul")
