"""The monitor inside a real Hugging Face Trainer (bf16 on a CPU, as the HF export runs it): a clean
run raises nothing; poisoned weights are found, and the Trainer writes no checkpoint of them."""

from __future__ import annotations

import pytest
import torch

import mixprec
from extras import require

pytestmark = pytest.mark.frameworks


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Accelerate keeps its state process-wide (the Trainer makes an Accelerator too): each test
    starts and ends without one, whichever framework's test ran before it in this process."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def train(tmp_path, steps, *, poison_at=None, pure_bf16=False, fp32=False, lr=5e-5, **monitor_kw):
    """bf16 autocast by default; ``pure_bf16``: bf16 weights, no autocast; ``fp32``: neither."""
    require("transformers", "frameworks")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from mixprec.monitor.hf import MonitorCallback

    w = mixprec.load_workload("hf:gpt2", seq_len=16, n_layer=1, n_embd=32, n_head=2)
    if pure_bf16:
        w.model.to(torch.bfloat16)  # weights, and so the updates, in bf16
    data = [{k: v[0] for k, v in w.make_batch(1, torch.device("cpu")).items()} for _ in range(steps * 2)]

    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == poison_at:
                with torch.no_grad():
                    model.lm_head.weight[0, 0] = float("nan")

    monitor = MonitorCallback(every=5, **monitor_kw)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=2,
        use_cpu=True,
        bf16=not (pure_bf16 or fp32),
        learning_rate=lr,
        save_steps=10,
        logging_steps=5,
        report_to=[],
        disable_tqdm=True,
    )
    callbacks = [Poison(), monitor] if poison_at is not None else [monitor]
    Trainer(model=w.model, args=args, train_dataset=data, callbacks=callbacks).train()
    return monitor, sorted(p.name for p in tmp_path.glob("checkpoint-*"))


def test_a_clean_hf_run_raises_nothing(tmp_path):
    monitor, checkpoints = train(tmp_path, 20)
    assert monitor.monitor.findings == [] and checkpoints == ["checkpoint-10", "checkpoint-20"]
    assert len(monitor.monitor.losses) == 20


def test_the_trainer_writes_no_checkpoint_of_poisoned_weights(tmp_path):
    monitor, checkpoints = train(tmp_path, 20, poison_at=12)
    kinds = [f.kind for f in monitor.monitor.findings]
    assert "nonfinite_weights" in kinds and "checkpoint_refused" in kinds
    assert checkpoints == ["checkpoint-10"]  # step 20's weights hold NaN: not written


def test_pure_bf16_weights_with_a_tiny_learning_rate_stall(tmp_path):
    monitor, _ = train(tmp_path, 10, pure_bf16=True, lr=1e-7)
    stall = next(f for f in monitor.monitor.findings if f.kind == "stall")
    assert stall.step == 0 and stall.evidence["stalled_fraction"] > 0.5


def test_a_bf16_stall_is_rescued_by_fp32_weights_inside_the_trainer(tmp_path):
    late = lambda m: sum(m.monitor.losses[-10:]) / 10  # noqa: E731
    fp32, _ = train(tmp_path / "fp32", 60, fp32=True, lr=1e-4)
    stalled, _ = train(tmp_path / "stalled", 60, pure_bf16=True, lr=1e-4)
    assert [f.kind for f in stalled.monitor.findings][:1] == ["stall"]
    rescued, _ = train(tmp_path / "rescued", 60, pure_bf16=True, lr=1e-4, rescue=True)
    assert [f.kind for f in rescued.monitor.findings] == ["stall", "rescue"]
    assert all(p.dtype == torch.float32 for p in rescued.monitor.model.parameters())
    # the Trainer's AdamW goes on with the widened state: the rescued run ends where fp32's does
    assert abs(late(rescued) - late(fp32)) < 0.1 * abs(late(stalled) - late(fp32))


def test_a_monitor_that_gives_up_stops_the_trainer_through_its_control(tmp_path):
    """Rescues spent (none allowed) on the pure-bf16 stall of step 0: the callback sets
    control.should_training_stop and the Trainer ends the run its own way after that step,
    on_train_end called; no exception leaves Trainer.train()."""
    require("transformers", "frameworks")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from mixprec.monitor.hf import MonitorCallback

    w = mixprec.load_workload("hf:gpt2", seq_len=16, n_layer=1, n_embd=32, n_head=2)
    w.model.to(torch.bfloat16)  # weights, and so the updates, in bf16: they stall at lr 1e-7
    data = [{k: v[0] for k, v in w.make_batch(1, torch.device("cpu")).items()} for _ in range(20)]
    ends = []

    class End(TrainerCallback):
        def on_train_end(self, args, state, control, **kw):
            ends.append(state.global_step)

    monitor = MonitorCallback(every=5, rescue=True, max_rescues=0)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=10,
        per_device_train_batch_size=2,
        use_cpu=True,
        learning_rate=1e-7,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=w.model, args=args, train_dataset=data, callbacks=[monitor, End()])
    trainer.train()
    assert [f.kind for f in monitor.monitor.findings] == ["stall", "stop"]
    assert "max_rescues=0" in monitor.monitor.stopped
    assert trainer.state.global_step == 1 and len(monitor.monitor.losses) == 1  # after the stalled step
    assert ends == [1]
