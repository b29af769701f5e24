"""A plain training loop over raw, unnormalised sensor readings (values in the tens of thousands, as
a CSV of meter counts would hold them): the first layer's outputs pass fp16's largest value (65504)
on this data, while the model trains fine in fp32 and bf16 (a LayerNorm follows it).

    python raw_sensors.py --steps 100 [--device cpu]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def readings(n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = 40_000 + 20_000 * torch.rand(n, 16, generator=g)  # raw counts, never normalised
    w = torch.randn(16, generator=g)
    y = ((x - 50_000) / 20_000) @ w
    return TensorDataset(x, y.unsqueeze(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(16, 128))
    model.add_module("norm", nn.LayerNorm(128))
    model.add_module("act", nn.GELU())
    model.add_module("head", nn.Linear(128, 1))
    model.to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(readings(), batch_size=64, shuffle=True)
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = F.mse_loss(model(x.to(args.device)), y.to(args.device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step >= args.steps:
                break
    print(f"final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
