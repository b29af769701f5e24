"""A model with one layer whose activations overflow fp16 (max 65504) but fit bf16 and fp32.

`amplify` maps its input to values around 4e5; the LayerNorm right after brings them back to
unit scale, so in fp32 or bf16 the model trains normally. Under fp16 autocast `amplify`'s
output is inf, the LayerNorm turns it into NaN, and every step is lost.

    mixprec check --workload examples/planted_overflow.py:workload --fix --plot check.png
"""

from __future__ import annotations

import torch
from torch import nn

import mixprec


class PlantedOverflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.amplify = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Sequential(nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
        with torch.no_grad():
            self.amplify.weight.mul_(1e5)  # activations ~4e5: beyond fp16's 65504

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.amplify(torch.tanh(self.embed(x)))))


def workload() -> mixprec.Workload:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = PlantedOverflow()
        teacher = torch.randn(32, 10)

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
        name="planted_overflow",
        default_batch_size=32,
        description="MLP whose 'amplify' layer overflows fp16",
    )
