"""A small plain loop that takes its batch size on the command line, for the micro-batch search
over a script (``tune --batch auto --batch-arg batch-size``):

    python batch_loop.py --batch-size 64 [--steps N] [--wide R] [--out weights.pt]

``--wide R``: each sample's hidden vector is broadcast to R copies and averaged back (no weights,
few FLOPs): R * 256 bytes per sample in fp32, half that under bf16 autocast, so the step's peak
memory grows with the batch as a large model's activations do."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, wide: int) -> None:
        super().__init__()
        self.inp, self.out, self.wide = nn.Linear(16, 64), nn.Linear(64, 4), wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        if self.wide:
            h = h.unsqueeze(-1).expand(-1, -1, self.wide).contiguous().mean(-1)
        return self.out(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--wide", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net(args.wide)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4096, 16, generator=g), torch.randint(0, 4, (4096,), generator=g)
    y = x[:, :4].argmax(1)  # a learnable target
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, generator=g)
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            step += 1
            if step >= args.steps:
                break
    if args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
