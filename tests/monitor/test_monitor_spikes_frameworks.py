"""Issue 37 inside the real frameworks: a data spike, a precision spike and a transient fault in a
Lightning fit and in a Hugging Face Trainer run (bf16 autocast on a CPU), each diagnosed before its
update lands and handled through the framework's own means: the update withheld inside its optimizer
step (the HF Trainer's scheduler skipped as after an overflow), the batch on a skip list in
Lightning's ``skip_batches.json`` form, a precision spike's module an fp32 island, a transient one
retried; no exception leaves the fit."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from monitor_faults import regression
from torch import nn

from extras import require
from mixprec.monitor.faults import FaultInjector

pytestmark = pytest.mark.frameworks

AT = 70  # the faulty step: after the spike test's warm-up (50 steps)
STEPS = 90


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def batches(*, bad=None, offset=None):
    """The regression's batches: step ``bad``'s targets 1000x, step ``offset``'s inputs + 300."""
    w = regression(bad, offset_at=offset, norm=offset is not None)
    torch.manual_seed(0)
    return w, [w.make_batch(32, torch.device("cpu")) for _ in range(STEPS)]


def diagnosed(monitor):
    return [
        (f.step, f.kind, f.evidence["verdict"], f.module) for f in monitor.findings if "verdict" in f.evidence
    ]


# ----------------------------------------------------------------------------------------- Lightning
def fit(tmp_path, w, data, *, transient=False, **monitor_kw):
    require("lightning", "frameworks")
    import lightning.pytorch as pl

    from mixprec.monitor.lightning import MonitorCallback

    holder = {}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = w.model

        def training_step(self, batch, batch_idx):
            return w.loss_fn(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.net.parameters(), lr=3e-3)

    callback = MonitorCallback(every=20, **monitor_kw)
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        precision="bf16-mixed",
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    if transient:
        holder["faults"] = FaultInjector(
            w.model, module="head", steps={AT}, transient=True, clock=lambda: trainer.global_step
        )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=None))
    return callback.monitor, trainer, holder.get("faults")


def test_lightning_withholds_a_data_spikes_update_and_lists_its_batch_in_skip_batches_json(tmp_path):
    w, data = batches(bad=AT)
    monitor, trainer, _ = fit(tmp_path, w, data, rescue=True)
    assert diagnosed(monitor) == [(AT, "spike", "data", None)], monitor.findings
    assert monitor.withheld == [AT] and monitor.healthy and trainer.global_step == STEPS
    assert json.loads((tmp_path / "skip_batches.json").read_text()) == [AT]  # Lightning's form
    assert second_moment(trainer.optimizers[0]) < 1e3  # the bad gradients never reached AdamW


def second_moment(optimizer):
    """AdamW's largest second moment: about 0.3 in the clean run, 1e4 once the bad batch's went in."""
    return max(float(s["exp_avg_sq"].max()) for s in optimizer.state.values())


def test_lightning_calls_a_precision_spike_precision_and_rescues_the_module(tmp_path):
    w, data = batches(offset=AT)
    monitor, _, _ = fit(tmp_path, w, data, rescue=True)
    assert diagnosed(monitor) == [(AT, "overflow", "precision", "net.norm")], monitor.findings
    assert [f.kind for f in monitor.findings] == ["overflow", "rescue"] and monitor.withheld == [AT]
    assert all(math.isfinite(v) for v in monitor.losses[AT + 1 :])
    assert all(torch.isfinite(p).all() for p in w.model.parameters())


def test_lightning_retries_a_transient_fault(tmp_path):
    w, data = batches()
    monitor, _, faults = fit(tmp_path, w, data, transient=True, rescue=True)
    assert faults.injected == [AT] and diagnosed(monitor) == [(AT, "spike", "transient", None)]
    assert "retried" in monitor.findings[0].action and monitor.healthy and monitor.withheld == []


def test_lightning_alert_only_leaves_the_run_unhealthy_and_stops_nothing(tmp_path):
    w, data = batches(bad=AT)
    monitor, trainer, _ = fit(tmp_path, w, data)
    assert diagnosed(monitor) == [(AT, "spike", "data", None)] and not monitor.healthy
    assert monitor.withheld == [] and trainer.global_step == STEPS
    assert not (tmp_path / "skip_batches.json").exists() and second_moment(trainer.optimizers[0]) > 1e3


# ------------------------------------------------------------------------------------ the HF Trainer
class Regressor(nn.Module):
    """The regression MLP as a Hugging Face model: keyword inputs, an output with its loss."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        out = self.net(x).float()
        return SequenceClassifierOutput(loss=F.mse_loss(out, labels), logits=out)


def hf_train(tmp_path, w, data, *, transient=False, **monitor_kw):
    require("transformers", "frameworks")
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from mixprec.monitor.hf import MonitorCallback

    rows = [{"x": x[i], "labels": y[i]} for x, y in data for i in range(len(x))]
    lrs = []

    class InOrder(Trainer):  # the batches in order: step k is data[k]
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    class LearningRates(TrainerCallback):
        def on_step_end(self, args, state, control, lr_scheduler=None, **kw):
            lrs.append(lr_scheduler.get_last_lr()[0])

    model = Regressor(w.model)
    monitor = MonitorCallback(every=20, **monitor_kw)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=32,
        use_cpu=True,
        bf16=True,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = InOrder(model=model, args=args, train_dataset=rows, callbacks=[monitor, LearningRates()])
    faults = None
    if transient:
        clock = lambda: trainer.state.global_step  # noqa: E731
        faults = FaultInjector(model, module="net.head", steps={AT}, transient=True, clock=clock)
    trainer.train()
    return monitor.monitor, trainer, faults, lrs


def test_hf_trainer_withholds_a_data_spikes_update_and_skips_its_scheduler_step(tmp_path):
    w, data = batches(bad=AT)
    monitor, trainer, _, lrs = hf_train(tmp_path, w, data, rescue=True)
    assert diagnosed(monitor) == [(AT, "spike", "data", None)], monitor.findings
    assert monitor.withheld == [AT] and monitor.healthy and trainer.state.global_step == STEPS
    assert json.loads((tmp_path / "skip_batches.json").read_text()) == [AT]
    assert second_moment(trainer.optimizer.optimizer) < 1e3
    # the Trainer skipped the scheduler's step as after an overflow: the rate held for one step
    assert lrs[AT] == lrs[AT - 1] and lrs[AT + 1] < lrs[AT] and lrs[AT - 1] < lrs[AT - 2]


def test_hf_trainer_calls_a_precision_spike_precision(tmp_path):
    w, data = batches(offset=AT)
    monitor, _, _, _ = hf_train(tmp_path, w, data, rescue=True)
    assert diagnosed(monitor) == [(AT, "overflow", "precision", "net.norm")], monitor.findings
    assert [f.kind for f in monitor.findings] == ["overflow", "rescue"] and monitor.withheld == [AT]
    assert all(torch.isfinite(p).all() for p in w.model.parameters())


def test_hf_trainer_retries_a_transient_fault(tmp_path):
    w, data = batches()
    monitor, _, faults, _ = hf_train(tmp_path, w, data, transient=True, rescue=True)
    assert faults.injected == [AT] and diagnosed(monitor) == [(AT, "spike", "transient", None)]
    assert "retried" in monitor.findings[0].action and monitor.healthy
