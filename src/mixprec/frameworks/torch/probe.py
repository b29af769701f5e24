"""Which precision a model's training step really computed in: the output dtype of its matmul and
convolution layers (autocast casts their inputs; an autocast that never reached them leaves fp32);
and the chaos floor's perturbed weights and the non-finite buffers a check reads of a model.
Light on purpose: the script agent uses it inside the user's process."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from mixprec.policy.hooks import OwnHook
from mixprec.policy.islands import is_fp32_island

# Layers whose output dtype shows which precision really ran (autocast casts their inputs).
_COMPUTE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Bilinear)


class FirstComputeLayer:
    """Forward hooks that record the first matmul/conv layer to run and its output dtype."""

    def __init__(self, model: nn.Module, keep_fp32: tuple[str, ...], *, training_only: bool = False) -> None:
        """``training_only``: only forwards that record gradients count (a script's evaluation under
        ``torch.no_grad()``, in fp32 before it trains, is not the training step)."""
        self.training_only = training_only
        self.dtypes: set[torch.dtype] = set()  # what every hooked layer computed in, until removed
        self.name: str | None = None
        self.dtype: torch.dtype | None = None
        self.module: nn.Module | None = None
        self._handles = []
        for name, module in model.named_modules():
            if not isinstance(module, _COMPUTE_LAYERS):
                continue
            if is_fp32_island(name, keep_fp32):
                continue  # fp32 islands run in fp32 on purpose
            # (an OwnHook: a copy of the model made meanwhile, an EMA, neither carries nor fires it)
            self._handles.append(module.register_forward_hook(OwnHook(self._hook(name), module)))
        # a complex or float64 layer autocast leaves alone is evidence only where no other layer ran
        # (a float64 model never ran the format; one float64 layer among fp32 ones says nothing)
        self._fallback: tuple[str, torch.dtype, nn.Module] | None = None

    def _hook(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not isinstance(output, torch.Tensor) or (self.training_only and not torch.is_grad_enabled()):
                return
            self.dtypes.add(output.dtype)
            if self.name is not None:
                return
            weight = stored_weight(module)
            if isinstance(weight, torch.Tensor) and (weight.is_complex() or weight.dtype == torch.float64):
                self._fallback = self._fallback or (name, output.dtype, module)
                return
            self.name, self.dtype, self.module = name, output.dtype, module

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.name is None and self._fallback is not None:
            self.name, self.dtype, self.module = self._fallback


def stored_weight(module: nn.Module) -> Any:
    """A layer's ``weight`` as it is stored: a parametrized one's original (reading ``weight``
    runs the parametrization: spectral_norm's power iteration, one more than the script's own)."""
    if parametrize.is_parametrized(module, "weight"):
        held: Any = module.parametrizations
        originals = held["weight"]
        return getattr(originals, "original", getattr(originals, "original0", None))  # (weight_norm's two)
    return getattr(module, "weight", None)


def in_functorch() -> bool:
    """Inside a torch.func transform: its tensors are wrappers that cannot be saved."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def perturb_weights(model: nn.Module, perturb: float) -> None:
    """Every weight times ``1 + perturb * N(0, 1)``, from a fixed generator (the chaos floor)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            p.mul_(1 + perturb * noise)


def nonfinite_buffers(model: nn.Module) -> list[str]:
    """Floating buffers (BatchNorm running statistics above all) holding inf or NaN: a model broken
    for evaluation, whatever its training loss says."""
    return [
        name
        for name, b in model.named_buffers()
        if b is not None and b.is_floating_point() and not bool(torch.isfinite(b).all())
    ]


def model_output(value: Any, nested: bool = False) -> torch.Tensor | None:
    """The model output a check compares (its output SQNR): the output itself where it is a float
    tensor, else the first float tensor inside it that is not a scalar, an HF output's ``logits``
    first: never its ``loss`` (a dict's, or the scalar that leads an HF ``return_dict=False``
    tuple), of which no output SQNR can be taken."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() and not (nested and value.dim() == 0) else None
    if isinstance(value, dict):
        value = [value[k] for k in ("logits", *value) if k in value and k != "loss"]
    elif hasattr(value, "logits"):
        value = [value.logits]
    if isinstance(value, (list, tuple)):
        for v in value:
            t = model_output(v, nested=True)
            if t is not None:
                return t
    return None
