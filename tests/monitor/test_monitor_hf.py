"""The monitor inside a real Hugging Face Trainer (bf16 on a CPU, as the HF export runs it): a clean
run raises nothing; poisoned weights are found, and the Trainer writes no checkpoint of them."""

from __future__ import annotations

import pytest
import torch

import mixprec
from extras import require

pytestmark = [pytest.mark.frameworks, pytest.mark.usefixtures("fresh_accelerator_state")]


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


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


class Classifier(torch.nn.Module):
    """A model the Trainer trains as it is, returning its loss in one of the forms the Trainer reads
    (``compute_loss``): a ModelOutput, a plain dict, a tuple with the loss first; or, for a Trainer
    that computes the loss itself (``compute_loss_func``), its logits alone."""

    def __init__(self, returns):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.returns = torch.nn.Linear(8, 3), returns

    def forward(self, x, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.lin(x)
        if self.returns == "logits":
            return (logits,)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if self.returns == "dict":
            return {"loss": loss, "logits": logits}
        if self.returns == "tuple":
            return (loss, logits)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def train_classifier(tmp_path, returns, *, before=(), save_strategy="steps", **trainer_kw):
    """20 steps (one epoch) of :class:`Classifier` in fp32, a NaN put into its weights after step 12;
    checkpoints every 10 steps (or at the epoch's end). ``before``: callbacks listed before the
    monitor (where the Trainer puts its report_to ones). Returns (monitor callback, checkpoints
    written, trainer)."""
    require("transformers", "frameworks")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from mixprec.monitor.hf import MonitorCallback

    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == 12:
                with torch.no_grad():
                    model.lin.weight[0, 0] = float("nan")

    torch.manual_seed(0)
    data = [{"x": torch.randn(8), "labels": torch.tensor(i % 3)} for i in range(40)]
    monitor = MonitorCallback(every=5)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=20,
        per_device_train_batch_size=2,
        use_cpu=True,
        save_strategy=save_strategy,
        save_steps=10,
        logging_steps=5,
        report_to=[],
        disable_tqdm=True,
    )
    callbacks = [*before, Poison(), monitor]
    trainer = Trainer(Classifier(returns), args, train_dataset=data, callbacks=callbacks, **trainer_kw)
    trainer.train()
    return monitor, sorted(p.name for p in tmp_path.glob("checkpoint-*")), trainer


@pytest.mark.parametrize("returns", ["dict", "tuple"])
def test_a_loss_in_a_dict_or_a_tuple_is_read_and_nan_weights_never_checkpointed(tmp_path, returns):
    """Issue 39 item 2: a model returning a plain dict {'loss', 'logits'} (the Trainer supports it):
    the monitor saw 0 losses of 20 steps, no finding, and checkpoint-20 held NaN weights."""
    monitor, checkpoints, _ = train_classifier(tmp_path, returns)
    assert len(monitor.monitor.losses) == 20
    assert [(f.step, f.kind) for f in monitor.monitor.findings] == [
        (12, "nonfinite_weights"),
        (20, "checkpoint_refused"),
    ]
    assert checkpoints == ["checkpoint-10"]


def test_a_loss_the_trainer_computes_itself_is_said_once_and_the_checkpoint_guard_holds(tmp_path):
    """The model returns its logits and the Trainer's compute_loss_func the loss: the monitor cannot
    read a loss; it says so once, and still writes no checkpoint of the NaN weights."""

    def loss_func(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.cross_entropy(outputs[0], labels)

    with pytest.warns(UserWarning, match="sees no step") as caught:
        monitor, checkpoints, _ = train_classifier(tmp_path, "logits", compute_loss_func=loss_func)
    assert sum("sees no step" in str(w.message) for w in caught) == 1
    assert monitor.monitor.losses == [] and checkpoints == ["checkpoint-10"]
    assert [f.kind for f in monitor.monitor.findings] == ["checkpoint_refused"]


def test_an_epoch_end_checkpoint_of_nan_weights_is_refused_too(tmp_path):
    """save_strategy="epoch": the Trainer decides to save after on_epoch_end, not on_step_end."""
    monitor, checkpoints, _ = train_classifier(tmp_path, "dict", save_strategy="epoch")
    assert checkpoints == [] and monitor.monitor.findings[-1].kind == "checkpoint_refused"


def test_findings_reach_the_trainers_log_history_and_every_callbacks_on_log(tmp_path):
    """Issue 39 item 8: log_history held no mixprec/* entry and a report_to-style callback (the
    Trainer lists those before the user's) saw none, though the docs promise TensorBoard and W&B
    see the findings."""
    from transformers import TrainerCallback

    class Reporter(TrainerCallback):
        def __init__(self):
            self.seen = {}

        def on_log(self, args, state, control, logs=None, **kw):
            self.seen.update({k: v for k, v in logs.items() if k.startswith("mixprec/")})

    reporter = Reporter()
    _, _, trainer = train_classifier(tmp_path, "model_output", before=[reporter])
    history = trainer.state.log_history
    logged = {k: v for entry in history for k, v in entry.items() if k.startswith("mixprec/")}
    assert logged == {"mixprec/nonfinite_weights": 12.0, "mixprec/checkpoint_refused": 20.0}
    assert reporter.seen == logged
