"""A timm model with timm's own optimizer factory (``pip install 'mixprec[timm]'``).

``timm.create_model(..., pretrained=False)`` builds the architecture with random weights
(nothing is downloaded); ``create_optimizer_v2(model, "adamw", ...)`` needs the module to exempt
biases, norm weights and ``model.no_weight_decay()`` from the weight decay, so ``optimizer_fn``
takes the model.

    mixprec tune --workload examples/timm_model.py:make_workload --model-config model_name=resnet18
    mixprec tune --model timm:convnext_atto   # the same, by name
"""

from __future__ import annotations

import timm
import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from torch import nn

import mixprec


def optimizer_fn(model: nn.Module) -> torch.optim.Optimizer:
    return create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)


def make_workload(
    model_name: str = "convnext_atto", image_size: int = 224, num_classes: int = 100
) -> mixprec.Workload:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = timm.create_model(model_name, pretrained=False, num_classes=num_classes)
    generator = torch.Generator().manual_seed(0)

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
        labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
        return images.to(device), labels.to(device)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels, label_smoothing=0.1)  # timm's train.py default

    return mixprec.Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        name=model_name,
        default_batch_size=32,
        description=f"timm {model_name}, {image_size} px synthetic images, {num_classes} classes",
    )
