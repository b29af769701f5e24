"""The monitor inside a real Lightning fit (fp16 autocast with Lightning's own GradScaler on a CPU,
as the Lightning export runs it; bf16-true for the stall): the faults of test_monitor.py raise the
same findings, rescue=True cures what blames the precision, a bad batch is never blamed on it, and
a poisoned checkpoint is never written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from monitor_faults import amplified, corrupt_batch, mlp, overflow_from

import mixprec
from extras import require

LATE = str(Path(__file__).parents[2] / "examples" / "late_overflow.py") + ":workload"

pytestmark = pytest.mark.frameworks


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def fit(
    workload,
    steps,
    tmp_path,
    *,
    fault=None,
    data_fault=None,
    precision="16-mixed",
    lr=None,
    optimizer=None,
    accumulate=1,
    **monitor_kw,
):
    """``workload`` trained by Lightning for ``steps`` steps with a MonitorCallback; ``fault(step,
    net, batch)`` as in test_monitor.py, ``data_fault`` the same applied to the data itself (what
    the DataLoader yields); ``optimizer(params)`` in place of the workload's (``lr``: SGD at it);
    ``accumulate``: Lightning's accumulate_grad_batches. Returns (monitor, trainer)."""
    require("lightning", "frameworks")
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from mixprec.monitor.lightning import MonitorCallback

    torch.manual_seed(0)
    size, count = workload.default_batch_size, steps * accumulate
    batches = [workload.make_batch(size, torch.device("cpu")) for _ in range(count)]
    if data_fault is not None:
        batches = [data_fault(i, None, b) for i, b in enumerate(batches)]

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = workload.model

        def training_step(self, batch, batch_idx):
            if fault is not None and self.training:
                batch = fault(self.global_step, self.net, batch)
            loss = workload.loss_fn(self.net, batch)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            if optimizer is not None:
                return optimizer(self.net.parameters())
            if lr is not None:
                return torch.optim.SGD(self.net.parameters(), lr=lr)
            return workload.make_optimizer(self.net)

    callback = MonitorCallback(**{"every": 20, **monitor_kw})
    plugins = (
        [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
        if precision == "16-mixed"
        else []
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        plugins=plugins,
        precision=None if plugins else precision,
        accumulate_grad_batches=accumulate,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(batches, batch_size=None))
    return callback.monitor, trainer


def kinds(monitor):
    return [(f.kind, f.module) for f in monitor.findings]


def test_lightning_fit_predicts_the_overflow_and_rescues_it(tmp_path):
    alert, _ = fit(mixprec.load_workload(LATE), 300, tmp_path, rescue=False)
    assert kinds(alert)[0] == ("predicted_overflow", "net.head") and ("overflow", "net.head") in kinds(alert)
    assert not math.isfinite(alert.losses[-1])  # left alone, it overflowed

    rescued, _ = fit(mixprec.load_workload(LATE), 300, tmp_path, rescue=True)
    assert kinds(rescued)[:2] == [("predicted_overflow", "net.head"), ("rescue", "net.head")]
    assert all(math.isfinite(v) for v in rescued.losses)


def test_lightning_bad_batch_is_the_data(tmp_path):
    monitor, _ = fit(mlp(), 200, tmp_path, data_fault=corrupt_batch(150), rescue=True)
    assert kinds(monitor) == [("bad_batch", None)] and monitor.findings[0].step == 150


def test_lightning_overflow_from_one_module_is_located_and_rescued(tmp_path):
    alert, _ = fit(amplified(), 140, tmp_path, fault=overflow_from(100))
    assert kinds(alert)[:2] == [("overflow", "net.2"), ("scale_collapse", "net.2")]
    rescued, _ = fit(amplified(), 200, tmp_path, fault=overflow_from(100), rescue=True)
    assert kinds(rescued)[:2] == [("overflow", "net.2"), ("rescue", "net.2")]
    assert all(math.isfinite(v) for v in rescued.losses[110:])


def test_lightning_bf16_true_stagnation_is_a_stall_and_rescued_to_bf16_mixed(tmp_path):
    late = lambda losses: sum(losses[-20:]) / 20  # noqa: E731
    fp32, _ = fit(mlp(), 300, tmp_path, precision="32-true", lr=1e-3)
    alert, _ = fit(mlp(), 300, tmp_path, precision="bf16-true", lr=1e-3)
    stall = alert.findings[0]
    assert (stall.step, stall.kind) == (0, "stall") and stall.evidence["stalled_fraction"] > 0.5
    assert "rescue" not in [f.kind for f in alert.findings]
    assert late(alert.losses) > 1.03 * late(fp32.losses)  # left alone: it learns visibly less

    rescued, trainer = fit(mlp(), 300, tmp_path, precision="bf16-true", lr=1e-3, rescue=True)
    assert [f.kind for f in rescued.findings] == ["stall", "rescue"]
    assert "replaced by bf16-mixed" in rescued.findings[1].message
    assert type(trainer.precision_plugin).__name__ == "MixedPrecision"
    assert all(p.dtype == torch.float32 for p in trainer.lightning_module.parameters())
    assert late(rescued.losses) == pytest.approx(late(fp32.losses), rel=0.01)


def test_lightning_never_writes_a_poisoned_checkpoint(tmp_path):
    from mixprec.monitor import PoisonedCheckpointError

    def nan_weight(step, net, batch):
        if step == 25:
            with torch.no_grad():
                net[2].weight[0, 0] = float("nan")
        return batch

    monitor, trainer = fit(mlp(), 30, tmp_path, fault=nan_weight, precision="bf16-mixed")
    path = tmp_path / "poisoned.ckpt"
    with pytest.raises(PoisonedCheckpointError, match="holds inf/NaN"):
        trainer.save_checkpoint(path)
    assert not path.exists()
    assert monitor.findings[0].kind == "nonfinite_weights" and monitor.findings[0].step == 25
    assert monitor.findings[-1].kind == "checkpoint_refused"


def test_a_monitor_that_gives_up_stops_the_fit_through_lightning(tmp_path):
    """Rescues spent (none allowed) on the bf16-true stall of step 0: the callback sets
    trainer.should_stop and Lightning ends the fit its own way after that batch, its end-of-fit
    hooks called; no exception leaves the fit."""
    require("lightning", "frameworks")
    import lightning.pytorch as pl

    from mixprec.monitor.lightning import MonitorCallback

    w = mlp()
    torch.manual_seed(0)
    batches = [w.make_batch(32, torch.device("cpu")) for _ in range(50)]

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = w.model

        def training_step(self, batch, batch_idx):
            return w.loss_fn(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=1e-3)

    class Ends(pl.Callback):
        def __init__(self):
            self.calls = []

        def on_train_end(self, trainer, pl_module):
            self.calls.append(("on_train_end", trainer.global_step))

        def on_fit_end(self, trainer, pl_module):
            self.calls.append(("on_fit_end", trainer.global_step))

    callback, ends = MonitorCallback(every=20, rescue=True, max_rescues=0), Ends()
    trainer = pl.Trainer(
        max_steps=50,
        accelerator="cpu",
        precision="bf16-true",
        callbacks=[callback, ends],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(batches, batch_size=None))
    monitor = callback.monitor
    assert [f.kind for f in monitor.findings] == ["stall", "stop"]
    assert "max_rescues=0" in monitor.stopped and trainer.should_stop
    assert trainer.global_step == 1 and len(monitor.losses) == 1  # stopped after the stalled step
    assert ends.calls == [("on_train_end", 1), ("on_fit_end", 1)]


def test_lightning_accumulated_micro_batches_are_no_stalled_updates(tmp_path):
    """Issue 39 item 7: bf16-true with accumulate_grad_batches=4 raised `stall` at step 0 with
    stalled_fraction 1.0: each micro-batch was a step, and the three that step no optimizer had
    gradients and unmoved weights. A step is an optimizer step; its stalls are counted at its update."""
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731 (bf16 holds its updates)
    monitor, trainer = fit(mlp(), 12, tmp_path, precision="bf16-true", optimizer=adamw, accumulate=4, every=2)
    assert monitor.findings == []
    assert trainer.global_step == 12 and len(monitor.losses) == 12  # one a step: its micro-batches' mean
    assert [step for step, _ in monitor.sampler.stalls] == [0, 2, 4, 6, 8, 10]
    assert max(share for _, share in monitor.sampler.stalls) < 0.05


def test_manual_optimization_is_never_stepped_by_the_monitor_and_a_bad_batch_is_the_data(tmp_path):
    """Issue 39 item 3: under manual optimization the fp32 shadow called training_step, which steps
    the optimizer itself (opt.step() ran 122 times for 120 steps), and two corrupt batches in a row
    were an `overflow`. Its replay now ends at training_step's manual_backward."""
    require("lightning", "frameworks")
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from mixprec.monitor.lightning import MonitorCallback

    w, first, second = mlp(), corrupt_batch(100), corrupt_batch(101)
    torch.manual_seed(0)
    batches = [first(i, None, second(i, None, w.make_batch(32, torch.device("cpu")))) for i in range(110)]
    stepped = []

    class Manual(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = w.model
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = w.loss_fn(self.net, batch)
            self.manual_backward(loss)
            opt.step()
            stepped.append(batch_idx)
            return loss

        def configure_optimizers(self):
            return w.make_optimizer(self.net)

    callback = MonitorCallback(every=20, rescue=True)
    trainer = pl.Trainer(
        max_steps=110,
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Manual(), torch.utils.data.DataLoader(batches, batch_size=None))
    assert stepped == list(range(110))  # one optimizer step a batch: the user's own
    assert kinds(callback.monitor) == [("bad_batch", None)] and callback.monitor.findings[0].step == 100
    assert len(callback.monitor.losses) == 110
