"""How any model enters mixprec: a Workload, and a picklable spec that rebuilds it elsewhere.

A Workload is the model, a batch factory, a loss function and an optimizer factory. The
spec (a model name with its options, or ``path/to/file.py:function`` /
``package.module:function``) lets a child process rebuild the same workload, so each candidate
can be measured in isolation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import UsageError
from mixprec.workload.output import quiet_after_first

Batch = Any
MakeBatch = Callable[[int, torch.device], Batch]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
# optimizer_fn(model) -> Optimizer; one written for the older optimizer_fn(params) still works (it is
# told apart by calling it: see Workload.make_optimizer).
OptimizerFn = Callable[[Any], torch.optim.Optimizer]

# The kinds of WorkloadSpec: a model by name (built-in, torchvision:, timm:, hf:) or a factory.
SPEC_KINDS = ("zoo", "model", "factory")
# What an optimizer_fn of the parameter form raises when it is handed the module (torch.optim's
# "optimizer can only optimize Tensors", "'Linear' object is not iterable", an attribute a module lacks).
_WRONG_FORM = (TypeError, AttributeError)


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum, as in the benchmark of SURF's 'Deep Learning on A100 GPUs' guide."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def function_name(fn: Callable[..., Any]) -> str:
    """``fn`` as a person finds it: its name and, for a Python function, ``file.py:line``."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__qualname__", None) or type(target).__name__
    code = getattr(target, "__code__", None)
    where = f" ({Path(code.co_filename).name}:{code.co_firstlineno})" if code is not None else ""
    return f"{name.rsplit('.', 1)[-1] if '<locals>' in name else name}{where}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
    group parameters, e.g. no weight decay for norms and biases). One written for the older
    ``optimizer_fn(params)`` still works: it fails on the module and builds on its parameters,
    which :meth:`make_optimizer` then hands it (decided by calling it, never by a parameter's
    name). Default: SGD with momentum.
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
        self._optimizer_form: tuple[Any, bool] | None = None  # (optimizer_fn, takes the module)

    @property
    def optimizer_takes_module(self) -> bool:
        """True when ``optimizer_fn`` is called with the module (the contract), False when calling
        it showed it wants the parameters (the older form)."""
        form = self._optimizer_form
        return form is None or form[0] is not self.optimizer_fn or form[1]

    def make_optimizer(self, model: nn.Module | Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer for ``model`` (the prepared copy being trained).

        ``optimizer_fn`` is called with the module. One that fails on it (``TypeError`` or
        ``AttributeError``: torch.optim's "optimizer can only optimize Tensors", a module's missing
        attribute) is called once more with ``model.parameters()``; if that builds, it is the older
        form and gets the parameters from then on. Failing both ways is one :class:`UsageError` line
        naming the function and the fix. What it prints (nanoGPT's "num decayed parameter tensors
        ...") shows the first time in this process only: every candidate builds an optimizer.
        """
        fn = self.optimizer_fn or default_optimizer
        if self._quiet_optimizer_fn is None:
            self._quiet_optimizer_fn = quiet_after_first(fn)
        call = self._quiet_optimizer_fn
        name = f"optimizer_fn {function_name(fn)} of workload {self.name!r}"
        if self.optimizer_fn is None:
            opt = call(model.parameters() if isinstance(model, nn.Module) else model)
        elif not isinstance(model, nn.Module):
            if self.optimizer_takes_module and self._optimizer_form is not None:
                raise UsageError(
                    f"{name} takes the model, but make_optimizer() was given parameters; pass the "
                    "module: workload.make_optimizer(model)."
                )
            try:
                opt = call(model)
            except _WRONG_FORM as exc:
                raise UsageError(
                    f"{name} was given parameters and failed ({_first_line(exc)}); it takes the model: "
                    "pass the module: workload.make_optimizer(model)."
                ) from exc
        elif self._optimizer_form is not None and self._optimizer_form[0] is self.optimizer_fn:
            opt = call(model if self._optimizer_form[1] else model.parameters())
        else:
            opt, takes_module = self._first_optimizer(call, model, name)
            self._optimizer_form = (self.optimizer_fn, takes_module)
        if not isinstance(opt, torch.optim.Optimizer):
            raise UsageError(
                f"{name} returned {type(opt).__name__}, expected a torch.optim.Optimizer; return e.g. "
                "torch.optim.AdamW(model.parameters())."
            )
        return opt

    @staticmethod
    def _first_optimizer(call: Callable[[Any], Any], model: nn.Module, name: str) -> tuple[Any, bool]:
        """The first call: with the module, then (the older form) with its parameters."""
        try:
            return call(model), True
        except _WRONG_FORM as with_model:
            try:
                return call(model.parameters()), False
            except _WRONG_FORM as with_params:
                raise UsageError(
                    f"{name} fails with the model ({_first_line(with_model)}) and with "
                    f"model.parameters() ({_first_line(with_params)}); optimizer_fn takes the model: "
                    "return e.g. torch.optim.AdamW(model.parameters(), lr=3e-4) from "
                    "optimizer_fn=lambda model: ..."
                ) from with_model
