"""fp8 training through torchao.float8: which Linear layers it converts, and the conversion itself.

torchao swaps ``nn.Linear`` for ``Float8Linear``: the forward matmul takes e4m3 operands, the
backward ones an e5m2 gradient, each with a dynamic scale (one per tensor for "tensorwise", one
per row for "rowwise"), accumulating in fp32. ``torch._scaled_mm`` needs both matmul dimensions
divisible by 16, so a Linear whose in or out features are not stays as it is (in bf16 under
autocast): :func:`fp8_layers` is the rule the policy, the lint (MP207) and the exports share.
torchao is an optional dependency (``pip install 'mixprec[fp8]'``) imported only here.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable
from typing import Any

from torch import nn

from mixprec.errors import UnsupportedError
from mixprec.policy.islands import is_fp32_island

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


def fp8_layers(model: nn.Module, keep_fp32: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """(converted, left as they are): the names of the model's Linear layers fp8 converts, and of
    those it leaves because a dimension is not a multiple of 16. Layers in fp32 islands are in
    neither list."""
    islands = tuple(keep_fp32)
    converted: list[str] = []
    left: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or is_fp32_island(name, islands):
            continue
        (converted if fp8_eligible(module) else left).append(name)
    return converted, left


def convert(model: nn.Module, recipe: str, keep_fp32: Iterable[str] = ()) -> list[str]:
    """Convert the model's eligible Linear layers to torchao's Float8Linear, in place; returns their
    names. fp32 islands are left out (they run outside autocast in fp32 by design)."""
    converted, _ = fp8_layers(model, keep_fp32)
    convert_layers(model, recipe, converted)
    return converted


def convert_layers(model: nn.Module, recipe: str, names: Iterable[str]) -> None:
    """Convert the named Linear layers of the model to torchao's Float8Linear, in place."""
    float8 = _float8()
    wanted = set(names)
    if wanted:
        float8.convert_to_float8_training(
            model,
            config=float8.Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda module, name: name in wanted,
        )
