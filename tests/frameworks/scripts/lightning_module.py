"""A Lightning-docs-style script: a LightningModule (a small convolutional classifier), a
DataLoader, Trainer(max_steps=..., precision=...).fit().

    python lightning_module.py --max-steps 200 [--precision 32-true|bf16-mixed] [--scheduler] [--callbacks]

``--scheduler``: configure_optimizers returns a cosine LR scheduler too; ``--callbacks``: a
ModelCheckpoint into ``ckpts/`` every 2 steps, a LearningRateMonitor and a CSVLogger into ``logs/``,
as the Lightning docs show them.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(pl.LightningModule):
    def __init__(self, lr: float = 1e-3, scheduler: bool = False) -> None:
        super().__init__()
        self.lr, self.scheduler = lr, scheduler
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def data(n: int = 2048) -> TensorDataset:
    """Images whose class is the brightest of ten fixed patterns: learnable, the same every run."""
    g = torch.Generator().manual_seed(1234)
    patterns = torch.randn(10, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    x = patterns[y] + 0.5 * torch.randn(n, 3, 32, 32, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--scheduler", action="store_true")
    parser.add_argument("--callbacks", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(0)
    own: dict = {"logger": False, "enable_checkpointing": False}
    if args.callbacks:
        from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
        from lightning.pytorch.loggers import CSVLogger

        checkpoint = ModelCheckpoint(dirpath="ckpts", every_n_train_steps=2, save_top_k=-1)
        own = {"logger": CSVLogger("logs"), "callbacks": [checkpoint, LearningRateMonitor("step")]}
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        precision=args.precision,
        enable_progress_bar=False,
        enable_model_summary=False,
        **own,
    )
    loader = DataLoader(data(), batch_size=args.batch_size, shuffle=True)
    trainer.fit(Classifier(scheduler=args.scheduler), loader)


if __name__ == "__main__":
    main()
