"""How any model enters mixprec: a Workload, and a picklable spec that rebuilds it elsewhere.

A Workload is the model, a batch factory, a loss function and an optimizer factory. The
spec (a model name with its options, or ``path/to/file.py:function`` /
``package.module:function``) lets a child process rebuild the same workload, so each candidate
can be measured in isolation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.errors import UsageError
from mixprec.workload.output import quiet_after_first

Batch = Any
MakeBatch = Callable[[int, torch.device], Batch]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
# optimizer_fn(model) -> Optimizer, or the older parameter-only form optimizer_fn(params).
OptimizerFn = Callable[[Any], torch.optim.Optimizer]

# First-parameter names that ask for the module itself (see :func:`optimizer_takes_module`).
MODULE_PARAMETER_NAMES = ("model", "module", "net", "network")
# The kinds of WorkloadSpec: a model by name (built-in, torchvision:, timm:, hf:) or a factory.
SPEC_KINDS = ("zoo", "model", "factory")


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum, as in the benchmark of SURF's 'Deep Learning on A100 GPUs' guide."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def optimizer_takes_module(fn: Callable[..., Any]) -> bool:
    """Whether ``optimizer_fn`` wants the model (``optimizer_fn(model)``) rather than its
    parameters (``optimizer_fn(params)``, the form mixprec accepted first).

    Decided by the signature, never by calling it: the first parameter annotated as an
    ``nn.Module`` (or a subclass), or named ``model``, ``module``, ``net`` or ``network``, gets the
    module; anything else (``params``, ``parameters``, a ``torch.optim`` class, a
    ``functools.partial`` of one) gets ``model.parameters()``.
    """
    try:
        signature = inspect.signature(fn, eval_str=True)  # resolves "nn.Module" and subclasses
    except (NameError, SyntaxError, AttributeError, TypeError):
        signature = None
    except ValueError:  # a builtin without a signature: the old form
        return False
    try:
        params = list((signature or inspect.signature(fn)).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if not positional:
        return False
    first = positional[0]
    annotation = first.annotation
    if isinstance(annotation, str):  # an annotation that did not resolve: read its text
        if annotation.strip("'\" ").rsplit(".", 1)[-1] == "Module":
            return True
    elif inspect.isclass(annotation) and issubclass(annotation, nn.Module):
        return True
    return first.name in MODULE_PARAMETER_NAMES


@dataclass(frozen=True)
class WorkloadSpec:
    """Enough to rebuild a Workload in another process.

    ``kind`` is 'zoo' (a built-in name), 'model' (``torchvision:NAME``, ``timm:NAME``,
    ``hf:ARCH``) or 'factory'; ``sizes`` are the options it was built with (image size, sequence
    length, ``--model-config`` overrides).
    """

    kind: str
    target: str  # model name, or 'file.py:function' / 'package.module:function'
    sizes: tuple[tuple[str, Any], ...] = ()  # e.g. (("image_size", 128),) or (("n_layer", 2),)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "sizes": dict(self.sizes)}


@dataclass
class Workload:
    """A model and how to train it for one step.

    ``make_batch(batch_size, device)`` returns a batch; ``loss_fn(model, batch)`` returns a
    scalar loss tensor; ``optimizer_fn(model)`` builds the optimizer from the module (so it can
    group parameters, e.g. no weight decay for norms and biases), or, in the older form,
    ``optimizer_fn(params)`` from its parameters (see :func:`optimizer_takes_module`). Default:
    SGD with momentum.
    """

    model: nn.Module
    make_batch: MakeBatch
    loss_fn: LossFn
    optimizer_fn: OptimizerFn | None = None
    name: str | None = None
    default_batch_size: int = 32
    spec: WorkloadSpec | None = field(default=None, repr=False)
    description: str = ""  # one line for reports, e.g. 'resnet50, 3x128x128 images'
    # What mixprec.workload.validate_workload already checked in this process: device, batch size
    # and the identity of each part (a part replaced since is checked again).
    _validated: set[tuple[Any, ...]] = field(default_factory=set, init=False, repr=False, compare=False)

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
        self._quiet_optimizer_fn: Callable[..., Any] | None = None

    @property
    def optimizer_takes_module(self) -> bool:
        """True when ``optimizer_fn`` is called with the module, False with its parameters."""
        return self.optimizer_fn is not None and optimizer_takes_module(self.optimizer_fn)

    def make_optimizer(self, model: nn.Module | Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer for ``model`` (the prepared copy being trained).

        ``optimizer_fn`` is called with the module or with ``model.parameters()``, as its
        signature asks. What it prints (nanoGPT's "num decayed parameter tensors ...") shows
        the first time in this process only: every candidate builds an optimizer.
        """
        fn = self.optimizer_fn or default_optimizer
        if isinstance(model, nn.Module):
            argument: Any = model if self.optimizer_takes_module else model.parameters()
        elif self.optimizer_takes_module:
            raise UsageError(
                f"optimizer_fn of workload {self.name!r} takes the model (its first parameter is "
                "named or annotated as a module), but make_optimizer() was given parameters; "
                "pass the module: workload.make_optimizer(model)."
            )
        else:
            argument = model
        if self._quiet_optimizer_fn is None:
            self._quiet_optimizer_fn = quiet_after_first(fn)
        opt = self._quiet_optimizer_fn(argument)
        if not isinstance(opt, torch.optim.Optimizer):
            raise UsageError(
                f"optimizer_fn of workload {self.name!r} returned {type(opt).__name__}, "
                "expected a torch.optim.Optimizer; return e.g. torch.optim.AdamW(model.parameters())."
            )
        return opt
