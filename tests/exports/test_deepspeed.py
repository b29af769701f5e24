"""The deepspeed export against the real DeepSpeed (the frameworks extra): CPU accelerator, one gloo
rank from tests/exports/conftest.one_rank."""

from __future__ import annotations

import pytest
import torch
from harness import (
    ACC_STEPS,
    CASES,
    FRAMEWORK_TOLERANCE,
    STEP_CASES,
    Net,
    accumulating,
    check_accumulation,
    counting_steps,
    micro_batches,
    require,
    run_case,
    run_deepspeed,
    with_sgd,
)

require("deepspeed")

import deepspeed  # noqa: E402

pytestmark = [pytest.mark.frameworks, pytest.mark.usefixtures("one_rank")]

# tf32: a CUDA math mode. fp16-true: DeepSpeed's loss scaler needs its fp16 section (fp32 master
# weights) or torch_autocast (fp32 parameters). The step scope: engine.step() is DeepSpeed's own.
REFUSED = {"tf32", "fp16-true", *STEP_CASES}


@pytest.mark.parametrize("case", CASES)
def test_export_runs_the_policy(case, tmp_path):
    run_case("deepspeed", case, REFUSED, lambda config: run_deepspeed(config, tmp_path))


def _initialize(model: torch.nn.Module, config: dict) -> object:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def test_without_a_batch_size_initialize_asserts():
    with pytest.raises(AssertionError, match="train_batch_size"):
        _initialize(Net(), {"gradient_clipping": 1.0})


def test_channels_last_before_initialize_crashes_its_broadcast():
    """Why the export applies channels_last after initialize()."""
    model = Net().to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="stride"):
        _initialize(model, {"train_micro_batch_size_per_gpu": 1})


def test_the_bf16_section_is_not_bf16_mixed():
    """Why bf16-mixed is torch_autocast: the "bf16" section casts the parameters and does not autocast."""
    model = Net()
    engine = _initialize(model, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}})
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not engine.torch_autocast_enabled()


def test_a_compiled_step_cannot_trace_the_engine():
    """Why the step scope is refused: wrapped in torch.compile, the engine's backward enters
    threading locks dynamo cannot enter, so those frames fall back to eager."""
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    torch._dynamo.reset()
    clear_compilation_metrics()
    engine = _initialize(torch.nn.Linear(2, 2), {"train_micro_batch_size_per_gpu": 1})

    @torch.compile
    def train_step(x: torch.Tensor) -> None:
        engine.backward(engine(x).square().mean())
        engine.step()

    train_step(torch.ones(4, 2))
    failed = [
        m for m in get_compilation_metrics() if m.fail_type and m.co_filename.endswith("runtime/engine.py")
    ]
    assert any("`lock` context manager" in (m.fail_reason or "") for m in failed), [m.co_name for m in failed]


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_accumulation_steps_once_per_effective_batch(policy, tmp_path):
    """train_micro_batch_size_per_gpu 4, gradient_accumulation_steps 3, engine.step() after every
    micro-batch: every optimizer step sees 12 samples, and the weights are the plain reference loop's
    (loss / 3 per micro-batch, divided by engine.backward)."""
    source = accumulating(policy)
    with counting_steps():
        run = run_deepspeed(source, tmp_path, loader=micro_batches(), edit=with_sgd)
    check_accumulation(source, run, "deepspeed", **FRAMEWORK_TOLERANCE)
    assert run.namespace["model_engine"].train_batch_size() == 12  # derived: 4 x 3 x one rank
    assert run.namespace["scheduler"].last_epoch == ACC_STEPS  # the loop's scheduler, per optimizer step


@pytest.mark.parametrize("name", ["fp16-mixed", "bf16-mixed"])
def test_a_checkpoint_carries_the_loss_scale_and_the_scheduler(name, tmp_path):
    """engine.save_checkpoint holds neither the loop's GradScaler (the scale restarted at init_scale
    after a resume: 1024, not the 512 the overflow left) nor the scheduler the loop steps."""
    from harness import SCALE_AFTER, cases

    config = cases()[name]  # fp16-mixed: init_scale 1024, one planted overflow
    first = run_deepspeed(config, tmp_path)
    first.namespace["save_checkpoint"](str(tmp_path / "ckpt"))
    resumed = run_deepspeed(config, tmp_path, loader=[])  # a fresh engine, no steps
    resumed.namespace["load_checkpoint"](str(tmp_path / "ckpt"))
    scheduler = resumed.namespace["scheduler"]
    assert scheduler.last_epoch == first.namespace["scheduler"].last_epoch > 0
    if name == "fp16-mixed":
        assert resumed.scaler.get_scale() == first.scaler.get_scale() == SCALE_AFTER


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_accumulation_added_to_ds_config_steps_the_scheduler_per_optimizer_step(policy, tmp_path):
    """Issue 39: the export without accumulation stepped the scheduler after every engine.step(); a
    user who adds gradient_accumulation_steps to its ds_config.json got a scheduler that stepped 8
    times for 4 optimizer steps. The loop checks the boundary in every DeepSpeed export."""
    from harness import PROBE, cases

    with counting_steps():
        run = run_deepspeed(cases()[policy], tmp_path, config={"gradient_accumulation_steps": 2})
    optimizer_steps = sum(event is None for event in PROBE.events)  # fp16: the overflowing one is skipped
    assert run.namespace["model_engine"].global_steps == 2  # 4 micro-batches, 2 per optimizer step
    assert run.namespace["scheduler"].last_epoch == optimizer_steps == (2 if policy == "bf16-mixed" else 1)
