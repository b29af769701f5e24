"""A regression head whose outputs grow as it learns, and overflow fp16 (max 65504) after about
150 steps: a late failure no check of its first steps sees as an overflow.

A frozen feature extractor feeds a linear head that learns to reach targets around 1e6 (think of
fine-tuning a head on a pretrained body, with a label scale nobody normalised). Adam moves every
head weight by about its learning rate per step in one direction, so the head's output grows by
about 450 per step: fine in fp32 and bf16 (fp32's range), out of fp16's range under fp16
autocast (a plain torch.amp loop first overflows at step 138: benchmarks/late_overflow.py).

    mixprec check --workload examples/late_overflow.py:workload --policies fp16-mixed,bf16-mixed --fix
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


class GrowingHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, 64), nn.Sigmoid())  # frozen: a pretrained body
        self.head = nn.Linear(64, 1)
        self.features.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(40.0 * self.features(x))


def workload() -> mixprec.Workload:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GrowingHead()
    teacher = torch.randn(16, generator=torch.Generator().manual_seed(1))

    def make_batch(batch_size: int, device: torch.device):
        x = torch.randn(batch_size, 16)
        return x.to(device), (1e6 + 1e5 * torch.tanh(x @ teacher)).to(device)

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        return F.l1_loss(model(batch[0]).float().squeeze(1), batch[1])  # bounded gradients: fp16 holds them

    return mixprec.Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        optimizer_fn=lambda model: torch.optim.Adam(model.head.parameters(), lr=0.35),
        name="late_overflow",
        default_batch_size=64,
        description="a linear head on frozen features whose output outgrows fp16 after ~150 steps",
    )
