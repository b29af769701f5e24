"""The monitor inside a real Lightning fit: the late fp16 overflow (fp16 autocast and Lightning's
own GradScaler on a CPU, as the Lightning export runs it) is predicted and, with rescue, cured by
an fp32 island; a poisoned checkpoint is never written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import mixprec
from extras import require

LATE = str(Path(__file__).parents[2] / "examples" / "late_overflow.py") + ":workload"

pytestmark = pytest.mark.frameworks


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def fit(steps, tmp_path, *, poison_at=None, **monitor_kw):
    require("lightning", "frameworks")
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from mixprec.monitor.lightning import MonitorCallback

    w = mixprec.load_workload(LATE)
    torch.manual_seed(0)
    batches = [w.make_batch(64, torch.device("cpu")) for _ in range(steps)]

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = w.model

        def training_step(self, batch, batch_idx):
            if poison_at is not None and self.global_step == poison_at:
                with torch.no_grad():
                    self.net.head.weight[0, 0] = float("nan")
            loss = w.loss_fn(self.net, batch)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.net.head.parameters(), lr=0.35)

    callback = MonitorCallback(every=20, **monitor_kw)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return callback.monitor, trainer


def test_lightning_fit_predicts_the_overflow_and_rescues_it(tmp_path):
    alert, _ = fit(300, tmp_path, rescue=False)
    kinds = [(f.kind, f.module) for f in alert.findings]
    assert kinds[0] == ("predicted_overflow", "net.head") and ("overflow", "net.head") in kinds
    assert not math.isfinite(alert.losses[-1])  # left alone, it overflowed

    rescued, _ = fit(300, tmp_path, rescue=True)
    kinds = [(f.kind, f.module) for f in rescued.findings]
    assert kinds[:2] == [("predicted_overflow", "net.head"), ("rescue", "net.head")]
    assert all(math.isfinite(v) for v in rescued.losses)


def test_lightning_never_writes_a_poisoned_checkpoint(tmp_path):
    from mixprec.monitor import PoisonedCheckpointError

    monitor, trainer = fit(30, tmp_path, poison_at=25)
    path = tmp_path / "poisoned.ckpt"
    with pytest.raises(PoisonedCheckpointError, match="holds inf/NaN"):
        trainer.save_checkpoint(path)
    assert not path.exists()
    assert monitor.findings[-1].kind == "checkpoint_refused"
