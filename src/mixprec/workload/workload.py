"""How any model enters mixprec: a Workload, and a picklable spec that rebuilds it elsewhere.

A Workload is the model, a batch factory, a loss function and an optimizer factory. The
spec (a zoo name with sizes, or ``path/to/file.py:function`` / ``package.module:function``)
lets a child process rebuild the same workload, so each candidate can be measured in
isolation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.errors import UsageError

Batch = Any
MakeBatch = Callable[[int, torch.device], Batch]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum, as in the seed's benchmark."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


@dataclass(frozen=True)
class WorkloadSpec:
    """Enough to rebuild a Workload in another process: ``kind`` is 'zoo' or 'factory'."""

    kind: str
    target: str  # zoo model name, or 'file.py:function' / 'package.module:function'
    sizes: tuple[tuple[str, int], ...] = ()  # e.g. (("image_size", 128),) for zoo models

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "sizes": dict(self.sizes)}


@dataclass
class Workload:
    """A model and how to train it for one step.

    ``make_batch(batch_size, device)`` returns a batch; ``loss_fn(model, batch)`` returns a
    scalar loss; ``optimizer_fn(params)`` builds the optimizer (default: SGD with momentum).
    """

    model: nn.Module
    make_batch: MakeBatch
    loss_fn: LossFn
    optimizer_fn: OptimizerFn | None = None
    name: str | None = None
    default_batch_size: int = 32
    spec: WorkloadSpec | None = field(default=None, repr=False)
    description: str = ""  # one line for reports, e.g. 'resnet50, 3x128x128 images'

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise UsageError(
                f"Workload.model must be a torch.nn.Module, got {type(self.model).__name__}; "
                "build the model in your factory and pass it as model=..."
            )
        for attr in ("make_batch", "loss_fn"):
            if not callable(getattr(self, attr)):
                raise UsageError(
                    f"Workload.{attr} must be callable, got {type(getattr(self, attr)).__name__}."
                )
        if self.optimizer_fn is not None and not callable(self.optimizer_fn):
            raise UsageError(f"Workload.optimizer_fn must be callable or None, got {self.optimizer_fn!r}.")
        if self.name is None:
            self.name = type(self.model).__name__.lower()

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        opt = (self.optimizer_fn or default_optimizer)(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise UsageError(
                f"optimizer_fn of workload {self.name!r} returned {type(opt).__name__}, "
                "expected a torch.optim.Optimizer."
            )
        return opt
