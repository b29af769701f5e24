"""A plain loop with a BatchNorm, whose data goes bad the ways data does: one batch of NaN inputs
(``--nan-at``), one batch whose targets are 1000x too large (``--spike-at``), or a pipeline that
yields NaN from some step on (``--broken-from``). It saves ``ckpt.pt`` every 10 steps and at the end.

    python bad_data.py --steps 100 [--nan-at 25] [--spike-at 80] [--broken-from 60]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--spike-at", type=int, default=-1)
    parser.add_argument("--broken-from", type=int, default=-1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 1, generator=g)
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=g)
        y = x @ teacher
        if step == args.nan_at or 0 <= args.broken_from <= step:
            x[3, 5] = float("nan")
        if step == args.spike_at:
            y = y * 1000.0
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            torch.save(model.state_dict(), "ckpt.pt")
    torch.save(model.state_dict(), "ckpt.pt")
    print(f"final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
