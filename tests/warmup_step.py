"""A small regression's whole training step, eager or compiled whole (compile_scope='step'), under
one of the recipes' warm-up optimizers: the learning rate after each of its five steps, and the
final weights (tests/workload/test_recipes.py on the CPU, tests/test_gpu_paths.py on a GPU)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn


def warm_up_rates(
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    compiled: bool,
    device: str = "cpu",
) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)).to(device)
    opt = make_optimizer(model.parameters())
    x, y = torch.randn(16, 8, device=device), torch.randn(16, 1, device=device)

    def step() -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    fn = torch.compile(step) if compiled else step
    rates = []
    for _ in range(5):
        fn()
        rates.append(float(opt.param_groups[0]["lr"]))
    return rates, [p.detach().cpu() for p in model.parameters()]
