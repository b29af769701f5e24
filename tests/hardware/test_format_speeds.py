"""'Native' means measured: a format whose kernels are slow here is called slow (issue 42: a Xeon
with AVX512-FP16 whose fp16 convolutions took ~35x fp32's time was called "native fp16")."""

from __future__ import annotations

import json

import pytest

from mixprec.cli import main
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
