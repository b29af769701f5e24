"""timm's convnext_atto as a mixprec workload: 128 px synthetic images, 1000 classes, AdamW."""

from __future__ import annotations

import timm
import torch
from torch import nn

import mixprec


def workload() -> mixprec.Workload:
    model = timm.create_model("convnext_atto", pretrained=False)

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch_size, 3, 128, 128, device=device), torch.randint(
            0, 1000, (batch_size,), device=device
        )

    return mixprec.Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1]),
        optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-3),
        name="timm-convnext_atto",
        default_batch_size=16,
    )
