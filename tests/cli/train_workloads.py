"""Tiny workloads for `mixprec train`'s input checks and its Ctrl-C test (tests/cli/test_train_inputs.py).

``workload(fault=...)``: a 4-feature linear classifier, trained as it is (``fault="none"``), or broken the
way a user breaks one: ``vector`` (the loss is per sample, not reduced), ``frozen`` (no parameter
requires grad), ``nanloss`` (the loss is NaN in strict fp32 from the first step). ``progress=PATH``: every
batch drawn appends a line there, so a test can wait for the run to be under way.
"""

from __future__ import annotations

import torch
from torch import nn

import mixprec


def workload(fault: str = "none", progress: str | None = None) -> mixprec.Workload:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    if fault == "frozen":
        model.requires_grad_(False)

    def make_batch(batch_size: int, device: torch.device):
        if progress is not None:
            with open(progress, "a") as f:
                f.write("batch\n")
        x = torch.randn(batch_size, 4, device=device)
        return x, (x[:, :3]).argmax(dim=1)

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        losses = nn.functional.cross_entropy(model(batch[0]).float(), batch[1], reduction="none")
        if fault == "vector":
            return losses
        if fault == "nanloss":
            return losses.mean() * float("nan")
        return losses.mean()

    return mixprec.Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1),
        name=f"tiny-{fault}",
        default_batch_size=8,
    )
