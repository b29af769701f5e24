"""The accelerate export against the real Accelerate (the frameworks extra), on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from harness import (
    CASES,
    FRAMEWORK_TOLERANCE,
    accumulating,
    check_accumulation,
    counting_steps,
    micro_loader,
    require,
    run_accelerate,
    run_case,
    with_sgd,
)

require("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.commands.config.config_args import load_config_from_file  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from mixprec.exports import export, split_sections  # noqa: E402
from mixprec.policy import Candidate, PolicyConfig  # noqa: E402

pytestmark = pytest.mark.frameworks

# tf32: a CUDA math mode. fp16 on a CPU: Accelerate runs no fp16 autocast there. fp16-true: its
# GradScaler refuses fp16 gradients.
REFUSED = {"tf32", "fp16-true"} | {c for c in CASES if c.startswith("fp16-mixed")}


@pytest.mark.parametrize("case", CASES)
def test_export_runs_the_policy(case):
    run_case("accelerate", case, REFUSED, run_accelerate)


def test_fp16_on_a_cpu_trains_in_plain_fp32_without_a_warning():
    """Why fp16-mixed on a CPU is refused: no autocast, no scaler, nothing said."""
    try:
        accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        assert accelerator.state.mixed_precision == "fp16"
        assert not accelerator.native_amp and accelerator.scaler is None
        with accelerator.autocast():
            assert not torch.is_autocast_enabled("cpu")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize(("impl", "skipped"), [("foreach", True), ("fused", False)])
def test_an_overflowing_fused_step_is_not_seen_as_skipped(impl, skipped):
    """Why fp16-mixed with a fused optimizer is refused for Accelerate and the HF Trainer: GradScaler
    runs a fused optimizer's step even on inf gradients (its kernel skips the update), so
    Accelerate's step_was_skipped, which decides whether the prepared scheduler steps, stays False."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **{impl: True})
    try:
        Accelerator(cpu=True)  # the state AcceleratedOptimizer reads
        scaler = torch.amp.GradScaler("cpu")
        wrapped = AcceleratedOptimizer(optimizer, scaler=scaler)
        weight = model.weight.detach().clone()
        scaler.scale(model(torch.full((1, 2), float("inf"))).sum()).backward()
        wrapped.step()
        assert torch.equal(model.weight, weight)  # the update was skipped either way
        assert wrapped.step_was_skipped is skipped
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_yaml_is_a_valid_launch_config(device, tmp_path):
    config = PolicyConfig("bf16-mixed", device)
    path = tmp_path / "default_config.yaml"
    path.write_text(split_sections(export(config, "accelerate"))["default_config.yaml"])
    loaded = load_config_from_file(str(path))
    assert loaded.distributed_type == "NO" and loaded.num_processes == 1
    assert loaded.mixed_precision == "bf16" and loaded.use_cpu == (device == "cpu")
    assert loaded.dynamo_config == {}
    compiled = Candidate("bf16-mixed", compile="max-autotune-no-cudagraphs")
    path.write_text(split_sections(export(compiled, "accelerate", device=device))["default_config.yaml"])
    loaded = load_config_from_file(str(path))
    assert loaded.dynamo_config == {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune-no-cudagraphs"}


def test_accelerate_launch_runs_the_export(tmp_path):
    """`accelerate launch --config_file <exported yaml> train.py`, as the header says."""
    sections = split_sections(export(PolicyConfig("bf16-mixed", "cpu", channels_last=True), "accelerate"))
    (tmp_path / "default_config.yaml").write_text(sections["default_config.yaml"])
    prelude = (
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from harness import PROBE, data_loader, fresh_model, loss_fn\n"
        "model, loader = fresh_model(), data_loader(False)\n"
    )
    check = (
        "\nassert PROBE.calls and all(c.out_dtype == torch.bfloat16 for c in PROBE.calls)\n"
        "assert all(c.input_cl for c in PROBE.calls if c.input_cl is not None)\n"
        "print('launched', accelerator.state.mixed_precision, accelerator.native_amp)\n"
    )
    (tmp_path / "train.py").write_text(prelude + sections["train.py"] + check)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "default_config.yaml"]
    result = subprocess.run(
        [*launcher, "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "launched bf16 True" in result.stdout


def test_accumulation_steps_once_per_effective_batch():
    """Accelerator(gradient_accumulation_steps=3) with accelerator.accumulate over DataLoader(batch_size=4):
    every optimizer step sees 12 samples, and the weights are the plain reference loop's (loss / 3 per
    micro-batch, divided by accelerator.backward). (fp16 on a CPU is refused.)"""
    source = accumulating("bf16-mixed")
    with counting_steps():
        run = run_accelerate(source, loader=micro_loader(), edit=with_sgd)
    check_accumulation(source, run, "accelerate", **FRAMEWORK_TOLERANCE)
