"""The optimizers of the built-in workloads, as their reference training recipes write them.

nanoGPT, the Hugging Face examples (``no_decay = ["bias", "LayerNorm.weight"]``), timm
(``filter_bias_and_bn``) and torchvision's newer recipes (``--norm-weight-decay 0.0``) all
exempt the same parameters from weight decay: biases and normalisation weights, i.e. every
parameter with fewer than two dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Groups = Callable[[nn.Module, float], list[dict[str, Any]]]


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: matrices and embeddings decay, biases and norm weights do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# --------------------------------------------------------------------------------------------------
# Recipes scaled to the batch, with a warm-up

# Steps over which the learning rate ramps linearly up to its value (Goyal et al. 2017's gradual
# warm-up, in steps rather than epochs: a check compares the first few).
WARMUP_STEPS = 3
# torchvision's SGD recipe warms up longer: ResNet-50 from random weights at 128 px, batch 16 and
# the linearly scaled 0.00625 falls and rebounds within 6 steps after a 3-step warm-up (loss 7.26 ->
# 3.42 -> 6.69) and falls steadily after a 10-step one (7.26 -> 3.08); Goyal et al. ramp over 5 epochs.
SGD_CNN_WARMUP_STEPS = 10


def _tensor_lr_ok(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the implementation the optimizer will run takes its learning rate as a tensor: every
    SGD one, Adam's for-loop and fused ones; Adam's foreach kernels only with ``capturable`` (CUDA).
    torch picks foreach by itself when every parameter is on CUDA and none was asked for."""
    if isinstance(optimizer, torch.optim.SGD):
        return True
    d = optimizer.defaults
    if d.get("fused") or d.get("capturable"):
        return True
    params = [p for g in optimizer.param_groups for p in g["params"]]
    foreach = d.get("foreach")
    if foreach is None:
        foreach = bool(params) and all(p.device.type == "cuda" for p in params)
    return not foreach


def _rate_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """Where a tensor learning rate lives: on the parameters' device only for the kernels that take
    it there (fused, capturable); else on the CPU. SGD's for-loop and foreach steps and Adam's
    for-loop step pass the rate as a number (``alpha=-lr``): a rate on the GPU is read back with one
    ``.item()`` per parameter or per parameter group, each a host-device synchronisation, every
    step (torch's own tutorial on a tensor rate under ``torch.compile`` keeps it on the CPU)."""
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    d = optimizer.defaults
    return device if d.get("fused") or d.get("capturable") else torch.device("cpu")


class _Warmup:
    """The learning rate ramps from ``lr / warmup_steps`` to ``lr`` over the first ``warmup_steps``
    optimizer steps, in every implementation alike (a verdict is shared by an optimizer's
    implementations). Where the implementation takes a tensor rate, the rate and the step count are
    tensors updated in place, so a step compiled whole (``torch.compile`` around ``optimizer.step()``)
    does not recompile as the rate changes; where it cannot (Adam's foreach kernels without
    ``capturable``), the rate is a float set before each step. ``base_lr`` per group is the rate
    after the warm-up."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]

    def _warm(self, warmup_steps: int) -> None:
        self.warmup_steps = max(0, int(warmup_steps))
        self.defaults["warmup_steps"] = self.warmup_steps
        self._warming = self.warmup_steps > 0
        self._tensor_lr = self._warming and _tensor_lr_ok(self)  # type: ignore[arg-type]
        device = _rate_device(self)  # type: ignore[arg-type]
        self._warm_count = torch.zeros((), device=device)
        self._float_count = 0
        first = 1 / self.warmup_steps if self._warming else 1.0
        for group in self.param_groups:
            lr = group["lr"]
            base = group.get("base_lr", float(lr.item() if isinstance(lr, torch.Tensor) else lr))
            group["base_lr"] = base
            # a fresh tensor per optimizer: a rebuilt one (another implementation) must not share it
            group["lr"] = torch.full((), base * first, device=device) if self._tensor_lr else base * first
        if self._warming and not self._tensor_lr:
            _advance_float_eagerly()

    def _advance(self) -> None:
        if not self._warming:
            return
        if self._tensor_lr:
            self._warm_count.add_(1)
            frac = torch.clamp(self._warm_count / self.warmup_steps, max=1.0)
            for group in self.param_groups:
                group["lr"].copy_(group["base_lr"] * frac)
            return
        self._advance_float()

    def _advance_float(self) -> None:
        # Host bookkeeping, always run eagerly: in a step compiled whole (compile_scope='step')
        # Dynamo refuses setattr on an optimizer (torch 2.11: "Attempted setattr on a user-defined
        # object that does not have an AttributeMutation mutation_type") or drops it (2.14: the
        # warm-up never advanced). The step after it recompiles for the new float rate.
        self._float_count += 1
        ratio = min(1.0, self._float_count / self.warmup_steps)
        for group in self.param_groups:
            group["lr"] = group["base_lr"] * ratio
        self._warming = ratio < 1.0


def _advance_float_eagerly() -> None:
    """``torch.compiler.disable`` on :meth:`_Warmup._advance_float`, applied when the first optimizer
    that needs it is made: applied at import, it imported torch._dynamo (seconds) into every mixprec
    command, most of which never compile anything."""
    if not getattr(_Warmup._advance_float, "_mixprec_eager", False):
        eager = torch.compiler.disable(_Warmup._advance_float)
        eager._mixprec_eager = True
        _Warmup._advance_float = eager  # type: ignore[method-assign]


class WarmupSGD(_Warmup, torch.optim.SGD):
    """``torch.optim.SGD`` with a linear warm-up of its learning rate (:class:`_Warmup`); its
    arguments are SGD's, so another implementation (foreach, fused) rebuilds it whole."""

    def __init__(
        self,
        params: Any,
        lr: Any = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        warmup_steps: int = WARMUP_STEPS,
    ) -> None:
        torch.optim.SGD.__init__(
            self,
            params,
            lr=float(lr.item()) if isinstance(lr, torch.Tensor) else lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
        )
        self._warm(warmup_steps)

    def step(self, closure: Any = None) -> Any:
        self._advance()
        return torch.optim.SGD.step(self, closure)


class WarmupAdamW(_Warmup, torch.optim.AdamW):
    """``torch.optim.AdamW`` with a linear warm-up of its learning rate (:class:`_Warmup`); its
    arguments are AdamW's, so another implementation (foreach, fused) rebuilds it whole."""

    def __init__(
        self,
        params: Any,
        lr: Any = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        warmup_steps: int = WARMUP_STEPS,
    ) -> None:
        torch.optim.AdamW.__init__(
            self,
            params,
            lr=float(lr.item()) if isinstance(lr, torch.Tensor) else lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
        )
        self._warm(warmup_steps)

    def step(self, closure: Any = None) -> Any:
        self._advance()
        return torch.optim.AdamW.step(self, closure)


@dataclass(frozen=True)
class Recipe:
    """A reference recipe's optimizer at the batch its learning rate was tuned for, scaled to the
    batch a run trains at: linearly for SGD (Goyal et al. 2017), by the square root for Adam
    (Malladi et al. 2022), with a linear warm-up over ``warmup_steps``.

    Attributes:
        source: where the recipe comes from, in words (shown in the workload's description).
        kind: 'sgd' (momentum) or 'adamw'.
        lr / batch: the learning rate and the batch it was tuned for.
        weight_decay: on matrices and embeddings only (biases and norms never decay).
        momentum / betas: SGD's momentum; AdamW's betas.
    """

    source: str
    kind: str
    lr: float
    batch: int
    weight_decay: float = 0.0
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = WARMUP_STEPS

    def lr_at(self, batch: int) -> float:
        """The learning rate at ``batch`` samples per optimizer step."""
        ratio = batch / self.batch
        return self.lr * (ratio if self.kind == "sgd" else math.sqrt(ratio))

    def build(self, model: nn.Module, batch: int, groups: Groups | None = None) -> torch.optim.Optimizer:
        """The optimizer at ``batch``; ``groups(model, weight_decay)`` makes the parameter groups
        (default :func:`weight_decay_groups`; timm's own exempts its ``no_weight_decay()`` too)."""
        groups_of = groups or weight_decay_groups
        lr = self.lr_at(batch)
        made = groups_of(model, self.weight_decay)
        if self.kind == "sgd":
            return WarmupSGD(made, lr=lr, momentum=self.momentum, warmup_steps=self.warmup_steps)
        return WarmupAdamW(made, lr=lr, betas=self.betas, warmup_steps=self.warmup_steps)

    def describe(self) -> str:
        """'SGD 0.1 at batch 256 (torchvision's classification recipe), scaled linearly to the
        task's batch, 3 warm-up steps'."""
        rule = "linearly" if self.kind == "sgd" else "by the square root"
        name = "SGD" if self.kind == "sgd" else "AdamW"
        return (
            f"{name} {self.lr:g} at batch {self.batch} ({self.source}), scaled {rule} to the task's "
            f"batch, {self.warmup_steps} warm-up steps"
        )


class BatchScaled:
    """A built-in task's ``optimizer_fn``: its :class:`Recipe` scaled to the task's default batch,
    one rate for every run of the workload. (A rate that followed the batch ``make_batch`` drew last
    gave the fp32 reference and a candidate different rates whenever anything else drew a batch in
    between: a second checker at another micro-batch, the thread probe, an in-process sweep.)"""

    def __init__(self, recipe: Recipe, default_batch: int, groups: Groups | None = None) -> None:
        self.recipe, self.batch, self.groups = recipe, default_batch, groups

    def __call__(self, model: nn.Module) -> torch.optim.Optimizer:
        return self.recipe.build(model, self.batch, self.groups)


# torchvision's classification recipe (references/classification/train.py): SGD 0.1 for batch 256,
# momentum 0.9, weight decay 1e-4 but none on norms and biases; at the CPU default's batch 16:
# 0.00625. The zoo CNNs and torchvision:NAME train with it.
TORCHVISION_RECIPE = Recipe(
    "torchvision's classification recipe",
    "sgd",
    0.1,
    256,
    weight_decay=1e-4,
    warmup_steps=SGD_CNN_WARMUP_STEPS,
)
