"""A model with one Linear that cannot live in fp8 or a block format, and three that can.

`mix` is a frozen projection (as a pretrained layer under LoRA is) with outlier weights: every
fourth input column holds 1e6, an outlier in every 32-element MXFP8 block, every 16-element NVFP4
block and every row of an fp8 rowwise scale. Those columns read constant channels of 1e-6, so in
fp32 or bf16 the layer is an ordinary Linear over the 96 informative features. A scale shared with
an outlier leaves the ordinary weights (~0.1) far below the format's smallest step: in fp8 or a
block format `mix` passes on nothing of its input, and the model cannot learn. Kept in bf16 (its
precision map), it trains like fp32.

    mixprec check --workload examples/planted_outlier.py:workload --policies fp8-rowwise,mxfp8 --fix
"""

from __future__ import annotations

import torch
from torch import nn

import mixprec

OUTLIER = 1e6


class PlantedOutlier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 96)
        self.mix = nn.Linear(128, 64)
        self.hidden = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)
        constant = torch.zeros(128, dtype=torch.bool)
        constant[::4] = True  # channels 0, 4, 8, ...: one in every block of 4
        self.register_buffer("constant", constant, persistent=False)
        with torch.no_grad():
            self.mix.weight[:, constant] = OUTLIER  # times the 1e-6 constants: O(1) each
        self.mix.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        wide = h.new_full((*h.shape[:-1], 128), 1 / OUTLIER)
        wide[..., ~self.constant] = h
        h = torch.relu(self.mix(wide))
        return self.head(torch.relu(self.hidden(h)))


def workload() -> mixprec.Workload:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = PlantedOutlier()
        teacher = torch.randn(32, 16)

    def make_batch(batch_size: int, device: torch.device):
        x = torch.randn(batch_size, 32)
        return x.to(device), (x @ teacher).argmax(dim=1).to(device)

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch[0]).float(), batch[1])

    return mixprec.Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-3),
        name="planted_outlier",
        default_batch_size=64,
        description="MLP whose 'mix' layer sees 1e6 outliers in every block",
    )
