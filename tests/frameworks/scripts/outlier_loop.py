"""A plain training loop whose model has one Linear no low format can train (the planted outlier of
examples/planted_outlier.py): the frozen ``mix`` projection holds 1e6 weights in every fourth input
column, reading constant channels of 1e-6, so fp8 and the block formats (MXFP8, NVFP4), whose scales
the outliers set, pass on nothing of its ordinary weights, and the model learns nothing; in fp32 or
bf16 it is an ordinary Linear. ``head`` takes any low format well, and ``embed`` (24 inputs: a
multiple of no format's block) none.

    python outlier_loop.py --steps 100
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

OUTLIER = 1e6


class Planted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(24, 96)
        self.mix = nn.Linear(128, 64)
        self.head = nn.Linear(64, 16)
        constant = torch.zeros(128, dtype=torch.bool)
        constant[::4] = True
        self.register_buffer("constant", constant, persistent=False)
        with torch.no_grad():
            self.mix.weight[:, constant] = OUTLIER  # times the 1e-6 constants: O(1) each
        self.mix.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        wide = h.new_full((*h.shape[:-1], 128), 1 / OUTLIER)
        wide[..., ~self.constant] = h
        return self.head(torch.relu(self.mix(wide)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Planted()
    teacher = torch.randn(24, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        x = torch.randn(64, 24)
        loss = F.cross_entropy(model(x), (x @ teacher).argmax(dim=1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    print(f"final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
