"""A short training run of a small built-in model under one policy: the setup smoke test."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from mixprec import validation
from mixprec.policy import Policy


@dataclass
class DemoResult:
    policy: str
    device: str
    steps: int
    losses: list[float] = field(default_factory=list)
    stepped: list[bool] = field(default_factory=list)
    output_dtype: str = ""
    param_dtype: str = ""
    seconds: float = 0.0
    stats: dict[str, object] = field(default_factory=dict)


def run_demo(policy: Policy, steps: int = 20, batch_size: int = 64, seed: int = 0) -> DemoResult:
    """Train a 3-layer MLP on a fixed synthetic regression task for ``steps`` steps."""
    validation.positive_int("steps", steps)
    validation.positive_int("batch_size", batch_size)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    teacher = torch.randn(64, 8, generator=gen)
    model = policy.prepare(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    result = DemoResult(policy=policy.config.label, device=str(policy.device), steps=steps)
    start = time.perf_counter()
    with policy.precision_scope():
        for _ in range(steps):
            x = torch.randn(batch_size, 64, generator=gen).to(policy.device)
            y = (x @ teacher.to(policy.device)).tanh()
            with policy.autocast():
                out = model(x)
                loss = nn.functional.mse_loss(out.float(), y)
            policy.backward(loss)
            result.stepped.append(policy.step(optimizer, clip_grad_norm=1.0))
            optimizer.zero_grad(set_to_none=True)
            result.losses.append(float(loss.detach()))
    result.seconds = time.perf_counter() - start
    result.output_dtype = str(out.dtype).removeprefix("torch.")
    result.param_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    result.stats = policy.stats.as_dict()
    return result
