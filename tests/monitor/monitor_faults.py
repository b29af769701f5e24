"""Workloads and faults the monitor's tests inject, in every loop they run through."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


def mlp() -> mixprec.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))

    def make_batch(b, device):
        x = torch.randn(b, 16)
        return x, (x @ teacher).argmax(1)

    return mixprec.Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=lambda m, batch: F.cross_entropy(m(batch[0]).float(), batch[1]),
        optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.05),
        name="mlp",
        default_batch_size=32,
    )


class Amplify(nn.Module):
    """x * gain / gain: exact in fp32, inf in fp16 once gain * |x| passes 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.tensor(1.0))

    def forward(self, x):
        return (x * self.gain) / self.gain


def amplified() -> mixprec.Workload:
    w = mlp()
    model = nn.Sequential(w.model[0], w.model[1], Amplify(), w.model[2])
    return mixprec.Workload(
        model=model, make_batch=w.make_batch, loss_fn=w.loss_fn, optimizer_fn=w.optimizer_fn, name="amp"
    )


def overflow_from(onset):
    def fault(step, model, batch):
        if step == onset:
            model[2].gain.fill_(1e6)  # from here on the module overflows fp16 at any loss scale
        return batch

    return fault


def corrupt_batch(at):
    """One batch whose inputs are 1e6 times too large (a corrupt record): fp32 shows it too."""

    def fault(step, model, batch):
        return (batch[0] * 1e6, batch[1]) if step == at else batch

    return fault
