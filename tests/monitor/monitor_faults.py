"""Workloads and faults the monitor's tests inject, in every loop they run through."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

CPU = torch.device("cpu")


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


# ---------------------------------------------------------------------------------------------
# Spikes (issue 37): a regression MLP under bf16-mixed whose batch ``bad_at`` carries targets 1000x
# too large (the plain fp32 loop spikes the same way: the data), a model whose bf16 moments cancel
# on one batch (the precision), and a fault put into one forward only (transient).

BAD_AT = 150  # the bad batch


def regression(bad_at: int | None = None, *, offset_at: int | None = None, norm: bool = False):
    """A regression MLP trained by AdamW through a lambda whose parameter is not named ``model``
    (the issue's optimizer_fn). ``bad_at``: that batch's targets are 1000x too large; ``norm``: a
    :class:`MomentNorm` first, and ``offset_at``: that batch's inputs carry an offset of 300 (bf16
    moments cancel on it; fp32's do not, and the normalised inputs, so the loss, are unchanged)."""
    torch.manual_seed(0)
    layers = [("body", nn.Linear(16, 64)), ("act", nn.ReLU()), ("head", nn.Linear(64, 1))]
    if norm:
        layers.insert(0, ("norm", MomentNorm()))
    model = nn.Sequential(OrderedDict(layers))
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    drawn = [0]

    def make_batch(b, device):
        step, drawn[0] = drawn[0], drawn[0] + 1
        x = torch.randn(b, 16)
        y = x @ teacher + 0.3 * torch.randn(b, 1)
        if step == bad_at:
            y = y * 1000.0
        if step == offset_at:
            x = x + 300.0
        return x.to(device), y.to(device)

    return mixprec.Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=lambda m, batch: F.mse_loss(m(batch[0]).float(), batch[1]),
        optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
        name="regression",
        default_batch_size=32,
    )


class MomentNorm(nn.Module):
    """Per-sample standardisation whose moments are matmuls: under bf16 autocast they run in bf16,
    and E[x^2] - E[x]^2 cancels when the inputs carry a large offset (300: 8 bits of bf16's
    mantissa gone), so the variance comes out 0 or negative and the output inf/NaN. fp32 holds it."""

    def forward(self, x):
        ones = torch.full((x.shape[1], 1), 1.0 / x.shape[1], device=x.device)
        mean = x @ ones
        var = (x * x) @ ones - mean * mean
        return (x - mean) * torch.rsqrt(var)


def bad_batch_mlp():
    """The issue's example, for ``mixprec train --workload``: batch 150's targets are 1000x."""
    return regression(BAD_AT)


def clean_mlp():
    return regression()


def precision_mlp():
    """For ``mixprec train``: batch 100's inputs carry an offset its bf16 moments cancel on."""
    return regression(offset_at=100, norm=True)


def transient_mlp():
    """For ``mixprec train``: the head's output x1000 in the first forward of step 100 only."""
    from mixprec.monitor.faults import FaultInjector

    w = regression()
    make_batch, drawn = w.make_batch, [0]

    def counted(b, device):
        drawn[0] += 1
        return make_batch(b, device)

    w.make_batch = counted
    w.faults = FaultInjector(w.model, module="head", steps={100}, transient=True, clock=lambda: drawn[0] - 1)
    return w


def loop(workload, steps, *, policy_name="bf16-mixed", before=True, faults=None, device=CPU, **monitor_kw):
    """A plain loop under a mixprec Policy that hands the loss and batch over before the optimizer
    step (``before=False``: only after, as loops written before issue 37 do). ``faults(model,
    optimizer)`` builds a FaultInjector. Returns (monitor, losses, policy, injector)."""
    policy = mixprec.get_policy(policy_name, device=device)
    model = policy.prepare(workload.model.to(device))
    optimizer = workload.make_optimizer(model)
    injector = faults(model, optimizer) if faults is not None else None
    monitor = mixprec.Monitor(
        model, policy, optimizer=optimizer, loss_fn=workload.loss_fn, every=20, **monitor_kw
    )
    torch.manual_seed(0)
    losses = []
    for step in range(steps):
        batch = workload.make_batch(32, device)
        with policy.autocast():
            loss = workload.loss_fn(model, batch)
        optimizer.zero_grad()
        policy.backward(loss)
        if before:
            monitor.before_step(loss, batch, batch_index=step)
        policy.step(optimizer)
        monitor.observe(loss, batch)
        losses.append(float(loss.detach()))
    monitor.close()
    if injector is not None:
        injector.close()
    return monitor, losses, policy, injector
