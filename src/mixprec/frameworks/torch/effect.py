"""Does a math-mode candidate (tf32, bf32) change anything on this workload?

TF32 and bf32 are library flags: cuBLAS/cuDNN or oneDNN decide per operation whether to honour
them. On some CPUs oneDNN applies bf16 internals to matmuls but leaves convolutions bit-identical
to fp32, so a bf32 row on a CNN would time fp32 under another label. The probe runs every
matmul/conv layer of one forward pass on the very inputs it saw under strict fp32, once more
under the candidate's math mode, and reports the share of FLOPs whose output changed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mixprec.policy import Candidate, get_policy
from mixprec.workload import Workload

_COMPUTE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# A candidate that changes less than this share of the matmul/conv FLOPs has no effect worth timing.
NO_EFFECT_SHARE = 0.05


@dataclass(frozen=True)
class Effect:
    """What a math mode changed in one forward pass.

    Attributes:
        changed_share: share of the matmul/conv FLOPs whose layer output changed bits.
        changed: names of the layers whose output changed.
        unchanged: names of the layers that computed bit-identical outputs.
        changed_kinds: 'matmul' and/or 'convolution': the kinds of layer that changed.
    """

    changed_share: float
    changed: tuple[str, ...] = field(default_factory=tuple)
    unchanged: tuple[str, ...] = field(default_factory=tuple)
    changed_kinds: tuple[str, ...] = field(default_factory=tuple)

    @property
    def no_effect(self) -> bool:
        return self.changed_share < NO_EFFECT_SHARE

    def describe(self, candidate: Candidate) -> str:
        kinds = " and ".join(self.changed_kinds)
        changed = f"; it changes only its {kinds} layers ({self.changed_share:.1%} of them)" if kinds else ""
        return (
            f"{candidate.policy} computes bit-identical results to strict fp32 in "
            f"{1 - self.changed_share:.1%} of this model's matmul/conv FLOPs on this device{changed}: "
            "timing it would measure fp32 under another label"
        )


def math_mode_effect(workload: Workload, candidate: Candidate, batch: Any, device: torch.device) -> Effect:
    """Run the probe for ``candidate`` (a tf32/bf32 math mode) on one ``batch``."""
    model = copy.deepcopy(workload.model).to(device)
    strict = get_policy("fp32", device=device)
    mode = get_policy(candidate.policy, device=device, check=False)
    seen: list[tuple[str, nn.Module, torch.Tensor, torch.Tensor]] = []

    def record(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                seen.append((name, module, args[0].detach(), output.detach()))

        return hook

    handles = [
        m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, _COMPUTE)
    ]
    try:
        with torch.no_grad(), strict.precision_scope():
            workload.loss_fn(model, batch)
    finally:
        for h in handles:
            h.remove()
    total = changed_flops = 0
    changed: list[str] = []
    unchanged: list[str] = []
    kinds: set[str] = set()
    with torch.no_grad():
        for name, module, inp, out in seen:
            with FlopCounterMode(display=False) as counter, mode.precision_scope():
                again = module(inp)
            flops = int(counter.get_total_flops())
            total += flops
            if torch.equal(again, out):
                unchanged.append(name)
            else:
                changed.append(name)
                changed_flops += flops
                kinds.add("matmul" if isinstance(module, nn.Linear) else "convolution")
    share = changed_flops / total if total else 1.0
    return Effect(share, tuple(changed), tuple(unchanged), tuple(sorted(kinds)))
