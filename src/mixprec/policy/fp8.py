"""fp8 training through torchao.float8: which Linear layers it converts, and the conversion itself.

torchao swaps ``nn.Linear`` for ``Float8Linear``: the forward matmul takes e4m3 operands, the
backward ones an e5m2 gradient, each with a dynamic scale (one per tensor for "tensorwise", one
per row for "rowwise"), accumulating in fp32. ``torch._scaled_mm`` needs both matmul dimensions
divisible by 16, so a Linear whose in or out features are not stays as it is (in bf16 under
autocast): :func:`fp8_eligible`, which :mod:`mixprec.policy.lowformat` (the layer plan, with the
precision map) applies, and the exports paste.
torchao is an optional dependency (``pip install 'mixprec[fp8]'``) imported only here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mixprec.errors import UnsupportedError

# torch._scaled_mm's constraint on both dimensions of an fp8 matmul.
FP8_DIVISOR = 16


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def _float8() -> Any:
    if not torchao_available():
        raise UnsupportedError(
            "fp8 policies run through torchao.float8, which is not installed: pip install 'mixprec[fp8]'"
        )
    # torchao registers pytree constants on import; torch 2.14 logs a deprecation warning for each
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        pytree_log.setLevel(level)
    return float8


def fp8_eligible(module: nn.Module) -> bool:
    """A plain Linear whose matmul dimensions torch._scaled_mm accepts."""
    return (
        type(module) is nn.Linear
        and module.in_features % FP8_DIVISOR == 0
        and module.out_features % FP8_DIVISOR == 0
    )


@functools.cache
def cpu_scaled_mm_takes(recipe: str) -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` runs ``recipe``'s scales: one per tensor
    everywhere, one per row only in newer releases (torch 2.11's oneDNN path asserts "only supports
    per-tensor scaling for CPU backend"; 2.14's runs it)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    rows = recipe == "rowwise"
    scale_a, scale_b = (torch.ones(16, 1), torch.ones(1, 16)) if rows else (torch.ones(()), torch.ones(()))
    try:
        torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def convert_layers(model: nn.Module, recipe: str, names: Iterable[str]) -> None:
    """Convert the named Linear layers of the model to torchao's Float8Linear, in place. On a CPU
    whose torch has no ``_scaled_mm`` kernel for the recipe's scales, torchao's emulated matmul
    (the same quantisation, the product of the dequantised operands in fp32) predicts it instead."""
    float8 = _float8()
    wanted = set(names)
    if not wanted:
        return
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    weight = next((p for p in model.parameters()), None)
    if weight is not None and weight.device.type == "cpu" and not cpu_scaled_mm_takes(recipe):
        config = dataclasses.replace(config, emulate=True)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, name: name in wanted
    )
