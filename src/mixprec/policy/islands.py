"""Which modules a keep_fp32 pattern list makes fp32 islands (shared by the policy, fp8, lint, measure)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn


def is_fp32_island(name: str, patterns: Iterable[str]) -> bool:
    """True when module ``name`` matches a keep_fp32 pattern or sits inside a module that does:
    its forward runs outside autocast, in fp32."""
    return bool(name) and any(
        fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns
    )


def island_names(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """The modules ``prepare`` wraps as fp32 islands: every named module matching a pattern."""
    patterns = list(patterns)
    return [n for n, _ in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def batch_norm_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's BatchNorm layers by name: what ``Policy.prepare`` keeps fp32 under a *-true policy
    (:func:`mixprec.policy.hooks.keep_batch_norm_fp32`, which exports paste whole and so repeats
    this test), what ``check_prepared`` expects fp32, and what the tuner's batching notes look for.
    FSDP2's plan does not call it: :func:`mixprec.distributed.fsdp2.fsdp_groups` (plain torch, pasted
    by the fsdp2 export) repeats the test to give each BatchNorm an fp32 group of its own."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
