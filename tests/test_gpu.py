"""CUDA paths that no CPU run can reach: run on a GPU machine, skipped with the reason elsewhere.

Timing with CUDA events, ``torch.cuda.max_memory_allocated``, TF32 on and off through the
``fp32_precision`` API (matmul *and* cuDNN conv) and its restore, ``NVIDIA_TF32_OVERRIDE=0``,
the datasheet peak table behind MFU, OOM rows, and the planted fp16 overflow on a real GPU.
The GradScaler parity on CUDA is in ``test_parity.py`` and the nccl/FSDP2 run in
``test_distributed.py``; both carry the same ``gpu`` marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec import state
from mixprec.hardware.peaks import peak_flops

pytestmark = pytest.mark.gpu

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def test_peak_table_knows_this_gpu():
    """MFU needs the datasheet peak of the card in hand; a GPU missing from the table loses MFU."""
    info = mixprec.detect("cuda")
    for key in ("fp32", "tf32", "bf16", "fp16", "fp8"):
        peak, source = peak_flops(info, key)
        assert peak is not None and peak > 1e12, f"{info.name}: {source}"
        assert "datasheet" in source


@pytest.mark.parametrize("op", ["matmul", "conv"])
def test_strict_fp32_really_disables_tf32(op):
    """fp32 means IEEE fp32 for cuBLAS and cuDNN alike; tf32 really rounds to 10 mantissa bits."""
    g = torch.Generator(device="cuda").manual_seed(0)
    if op == "matmul":
        a = torch.randn(1024, 1024, device="cuda", generator=g)
        b = torch.randn(1024, 1024, device="cuda", generator=g)

        def run(x=a, y=b):
            return x @ y
    else:
        a = torch.randn(8, 64, 32, 32, device="cuda", generator=g)
        b = torch.randn(64, 64, 3, 3, device="cuda", generator=g)

        def run(x=a, y=b):
            return F.conv2d(x, y, padding=1)

    ref = run(a.double(), b.double())
    with mixprec.get_policy("fp32", device="cuda").precision_scope():
        strict = run()
    with mixprec.get_policy("tf32", device="cuda").precision_scope():
        tf32 = run()
    # Measured on an H100: strict ~1e-7 (fp32 accumulation), tf32 ~3e-4 (10-bit mantissa inputs).
    assert _rel_err(strict, ref) < 1e-5
    assert _rel_err(tf32, ref) > 5e-5
    assert not torch.equal(strict, tf32)


def test_precision_scope_restores_every_knob_and_the_defaults_still_apply():
    before = state.snapshot()
    default_conv = state.effective_state()["cudnn.conv"]
    with mixprec.get_policy("fp32", device="cuda").precision_scope():
        inside = state.effective_state()
        assert inside["cuda.matmul"] == "ieee" and inside["cudnn.conv"] == "ieee"
    with mixprec.get_policy("tf32", device="cuda").precision_scope():
        inside = state.effective_state()
        assert inside["cuda.matmul"] == "tf32" and inside["cudnn.conv"] == "tf32"
    assert state.snapshot() == before
    # PyTorch's own default is TF32 for cuDNN convolutions: the trap strict fp32 exists for.
    assert state.effective_state()["cudnn.conv"] == default_conv


_OVERRIDE_PROBE = """
import json, torch, mixprec
info = mixprec.detect("cuda")
a = torch.randn(1024, 1024, device="cuda")
with mixprec.get_policy("fp32", device="cuda").precision_scope():
    strict = a @ a
with mixprec.get_policy("tf32", device="cuda", check=False).precision_scope():
    asked_tf32 = a @ a
exact = a.double() @ a.double()
def error(m):
    return ((m.double() - exact).abs().max() / exact.abs().max()).item()
print(json.dumps({
    "supported": bool(mixprec.check_support("tf32", info)),
    "reason": mixprec.check_support("tf32", info).reason,
    # TF32's 10-bit mantissa: ~1e-3 of the largest value; fp32's ~1e-6. (Not bit equality: with the
    # request cuBLAS may pick another fp32 kernel, another summation order; the third H200 lease)
    "tf32_request_honoured": error(asked_tf32) > 1e-4,
    "errors": [error(strict), error(asked_tf32)],
    "env_reports": mixprec.hardware.environment.collect("cuda")["precision_state"]["NVIDIA_TF32_OVERRIDE"],
    "effective_conv": mixprec.hardware.environment.collect("cuda")["precision_state"]["cudnn.conv"],
}))
"""


def test_nvidia_tf32_override_zero_is_detected_and_really_forces_fp32():
    env = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", "import mixprec.hardware.environment\n" + _OVERRIDE_PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["supported"] is False and "NVIDIA_TF32_OVERRIDE=0" in probe["reason"]
    assert probe["tf32_request_honoured"] is False, probe["errors"]  # the driver ignores the request
    assert probe["env_reports"] == "0"
    assert probe["effective_conv"] == "ieee (NVIDIA_TF32_OVERRIDE=0)"


def test_isolated_cuda_sweep_times_with_events_and_reports_gpu_memory():
    result = mixprec.bench(
        mixprec.load_workload("mlp"),
        policies="fp32,tf32,bf16-mixed,fp16-mixed,bf16-true",
        channels_last="off",
        batch_size=256,
        steps=5,
        warmup=3,
        device="cuda",
    )
    rows = {r.label: r for r in result.rows}
    expected_dtype = {
        "fp32": "float32",
        "tf32": "float32",
        "bf16-mixed": "bfloat16",
        "fp16-mixed": "float16",
        "bf16-true": "bfloat16",
    }
    for label, dtype in expected_dtype.items():
        row = rows[label]
        assert row.status == "ok", (label, row.reason)
        assert row.observed_dtype == dtype
        assert row.memory_method == "torch.cuda.max_memory_allocated"
        assert row.peak_memory_bytes and row.peak_memory_bytes > 0
        assert row.step_time_ms and row.step_time_ms.n >= 5 and row.step_time_ms.median_ms > 0
        assert row.mfu is not None and 0 < row.mfu <= 1.0
        assert "datasheet" in row.peak_flops_source
    assert result.settings["cudnn_benchmark"] is True


def test_in_process_cuda_sweep_leaves_global_state_alone():
    """In-process runs toggle cudnn.benchmark and precision knobs; the conftest guard checks the restore."""
    result = mixprec.bench(
        mixprec.load_workload("resnet50", image_size=32),
        policies="fp32,bf16-mixed",
        channels_last="both",
        batch_size=8,
        steps=2,
        warmup=2,
        device="cuda",
        isolate=False,
    )
    assert {r.status for r in result.rows} == {"ok"}, [(r.label, r.reason) for r in result.rows]
    assert all(r.memory_method == "torch.cuda.max_memory_allocated" for r in result.rows)


def test_an_allocation_beyond_the_card_is_an_oom_row():
    free, _ = torch.cuda.mem_get_info()
    side = int((free / 4) ** 0.5) * 2  # one fp32 batch tensor of about 4x the free memory
    workload = mixprec.Workload(
        model=torch.nn.Linear(8, 8),
        make_batch=lambda bs, device: torch.empty(side, side, device=device),
        loss_fn=lambda model, batch: batch.sum(),
        name="too-big",
    )
    result = mixprec.bench(
        workload, policies="fp32", channels_last="off", steps=1, warmup=1, device="cuda", isolate=False
    )
    assert result.rows[0].status == "oom", result.rows[0].reason


def test_planted_fp16_overflow_fails_on_cuda_and_the_fix_holds():
    from mixprec.checking.check import check

    workload = mixprec.load_workload(f"{EXAMPLES / 'planted_overflow.py'}:workload")
    result = check(workload, policies=("fp16-mixed", "bf16-mixed"), steps=6, device="cuda", fix=True)
    by_policy = {c.candidate.policy: c for c in result.candidates}
    fp16 = by_policy["fp16-mixed"]
    assert fp16.verdict == "fail"
    assert fp16.first_nonfinite_forward == "amplify"
    assert fp16.fix_keep_fp32 == ["amplify"] and fp16.fix_verified, fp16.fix_note
    assert by_policy["bf16-mixed"].verdict == "pass"
