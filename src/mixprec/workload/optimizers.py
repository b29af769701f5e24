"""The optimizers of the built-in workloads, as their reference training recipes write them.

nanoGPT, the Hugging Face examples (``no_decay = ["bias", "LayerNorm.weight"]``), timm
(``filter_bias_and_bn``) and torchvision's newer recipes (``--norm-weight-decay 0.0``) all
exempt the same parameters from weight decay: biases and normalisation weights, i.e. every
parameter with fewer than two dimensions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: matrices and embeddings decay, biases and norm weights do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999)
) -> torch.optim.Optimizer:
    """AdamW with the no-decay group for biases and norm weights."""
    return torch.optim.AdamW(weight_decay_groups(model, weight_decay), lr=lr, betas=betas)


def sgd(model: nn.Module, *, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """SGD with momentum and the no-decay group (torchvision's ``--norm-weight-decay 0.0``)."""
    return torch.optim.SGD(weight_decay_groups(model, weight_decay), lr=lr, momentum=momentum)
