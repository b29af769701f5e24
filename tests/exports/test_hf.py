"""The hf export against the real HF Trainer (transformers, the frameworks extra), on CPU."""

from __future__ import annotations

import pytest
from harness import (
    ACC,
    ACC_STEPS,
    CASES,
    FRAMEWORK_TOLERANCE,
    SGD_LR,
    STEP_CASES,
    DictDataset,
    HFNet,
    accumulating,
    check_accumulation,
    counting_steps,
    require,
    run_case,
    run_hf,
)

require("transformers")

from accelerate.state import AcceleratorState  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

pytestmark = pytest.mark.frameworks

# tf32: a CUDA math mode. fp16 on a CPU: the Trainer's Accelerator runs no fp16 autocast there.
# fp16-true: its GradScaler refuses fp16 gradients. The step scope: the Trainer owns its loop.
REFUSED = {"tf32", "fp16-true", *STEP_CASES} | {c for c in CASES if c.startswith("fp16-mixed")}


@pytest.mark.parametrize("case", CASES)
def test_export_runs_the_policy(case, tmp_path):
    run_case("hf", case, REFUSED, lambda config: run_hf(config, tmp_path))


def test_fp16_on_a_cpu_trains_in_plain_fp32_without_a_warning(tmp_path):
    """Why fp16-mixed on a CPU is refused for the Trainer too."""
    args = TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, report_to="none")
    try:
        trainer = Trainer(model=HFNet(), args=args, train_dataset=DictDataset(False))
        assert trainer.accelerator.state.mixed_precision == "fp16"
        assert not trainer.accelerator.native_amp and trainer.accelerator.scaler is None
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_accumulation_steps_once_per_effective_batch(tmp_path):
    """per_device_train_batch_size=4, gradient_accumulation_steps=3 from the export (the user's
    arguments name neither): every optimizer step sees 12 samples, and the weights are the plain
    reference loop's (loss / 3 per micro-batch, divided by the Trainer). (fp16 on a CPU is refused.)"""
    source = accumulating("bf16-mixed")
    args = {
        "per_device_train_batch_size": None,  # the export sets it
        "max_steps": ACC_STEPS,
        "optim": "sgd",
        "learning_rate": SGD_LR,
        "lr_scheduler_type": "constant",
        "train_sampling_strategy": "sequential",  # the samples in order, as the reference takes them
    }
    with counting_steps():
        run = run_hf(source, tmp_path, dataset=DictDataset(False, ACC), args=args)
    check_accumulation(source, run, "hf", scheduler=False, **FRAMEWORK_TOLERANCE)
