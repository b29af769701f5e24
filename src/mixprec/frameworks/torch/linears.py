"""The Linear layers of a torch workload as a low-format policy sees them: each one's GEMM shapes,
its share of the training step's FLOPs, and how much of its operands the format's quantisation
loses, all from one fp32 forward and backward on a copy of the model."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mixprec.numerics.formats import quantize_scaled
from mixprec.policy.blockscale import BLOCK_FORMATS, quantize
from mixprec.policy.lowformat import plan_layers
from mixprec.policy.registry import PolicySpec
from mixprec.workload import Workload


@dataclass
class LinearCensus:
    """Attributes:
    shapes: Linear name -> (M tokens, K in features, N out features) at the checked batch.
    directions: Linear name -> the GEMMs its step runs (no dgrad for a layer whose input needs no
        gradient, no wgrad for a frozen weight).
    step_flops: FLOPs of one forward and backward of the whole model (torch's FlopCounterMode).
    sqnr_db: Linear name -> the SQNR of its worst GEMM's result with the operands quantised as the
        format quantises them, against fp32: where the format loses the most, the first suspect.
    """

    shapes: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    directions: dict[str, frozenset[str]] = field(default_factory=dict)
    step_flops: float = 0.0
    sqnr_db: dict[str, float] = field(default_factory=dict)

    def gemm_flops(self, name: str) -> float:
        """One GEMM direction's FLOPs (all three have ``2*M*K*N``)."""
        m, k, n = self.shapes[name]
        return 2.0 * m * k * n

    def low_share(self, low: dict[str, frozenset[str]]) -> float:
        """The share of the step's FLOPs in GEMMs the format runs (``low``: a LayerPlan's)."""
        done = sum(
            self.gemm_flops(n) * len(dirs & self.directions.get(n, dirs))
            for n, dirs in low.items()
            if n in self.shapes
        )
        return done / self.step_flops if self.step_flops else 0.0


def _sqnr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    noise = (x - q).double().pow(2).sum().item()
    signal = x.double().pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _quantized(x: torch.Tensor, spec: PolicySpec, weight: bool = False) -> torch.Tensor:
    """``x`` (2-D, reduction dimension last) as the format stores it for a GEMM, dequantised to fp32
    (round-to-nearest: the census leaves out stochastic rounding)."""
    x = x.float().contiguous()
    if spec.block_format is not None:
        fmt = BLOCK_FORMATS[spec.block_format]
        return quantize(x, fmt, tiles=weight and fmt.weight_tiles)
    amax = x.abs().amax(-1, keepdim=True) if spec.fp8_recipe == "rowwise" else None
    return quantize_scaled(x, "fp8_e4m3", amax)


def _gemm_sqnr(a: torch.Tensor, b: torch.Tensor, spec: PolicySpec, b_is_weight: bool = False) -> float:
    """SQNR of ``a @ b.T`` (both with the reduction dimension last) with quantised operands."""
    exact = a.float() @ b.float().t()
    return _sqnr_db(exact, _quantized(a, spec) @ _quantized(b, spec, b_is_weight).t())


def census(
    workload: Workload, spec: PolicySpec, batch: Any, device: str, keep_fp32: Sequence[str] = ()
) -> LinearCensus:
    """Shapes, FLOPs and quantised-GEMM SQNRs of the Linear layers ``spec`` would convert (fp32
    islands, ``keep_fp32``, left out: they run in fp32)."""
    model = copy.deepcopy(workload.model).to(device)
    plan = plan_layers(model, spec, keep_fp32)
    modules = dict(model.named_modules())
    found = LinearCensus()
    operands: dict[str, list[float]] = {}

    saved: dict[str, torch.Tensor] = {}

    def forward_hook(name: str) -> Any:
        def hook(module: nn.Linear, args: tuple, output: Any) -> None:
            x = args[0].detach().reshape(-1, module.in_features).float()
            w = module.weight.detach().float()
            found.shapes[name] = (x.shape[0], module.in_features, module.out_features)
            found.directions[name] = frozenset(
                ["forward"]
                + (["dgrad"] if args[0].requires_grad else [])
                + (["wgrad"] if module.weight.requires_grad else [])
            )
            operands[name] = [_gemm_sqnr(x, w, spec, b_is_weight=True)]
            saved[name] = x

        return hook

    def backward_hook(name: str) -> Any:
        def hook(module: nn.Linear, grad_input: tuple, grad_output: tuple) -> None:
            dy = grad_output[0]
            if dy is None or name not in saved:
                return
            dy = dy.detach().reshape(-1, module.out_features).float()
            x, w = saved.pop(name), module.weight.detach().float()
            if "dgrad" in found.directions[name]:  # dy @ W: reduces over the out features
                operands[name].append(_gemm_sqnr(dy, w.t(), spec, b_is_weight=True))
            if "wgrad" in found.directions[name]:  # dy^T @ x: reduces over the tokens
                operands[name].append(_gemm_sqnr(dy.t(), x.t(), spec))

        return hook

    handles = []
    for name in plan.low:
        handles.append(modules[name].register_forward_hook(forward_hook(name)))
        handles.append(modules[name].register_full_backward_hook(backward_hook(name)))
    try:
        with warnings.catch_warnings():
            # a model whose input needs no gradient: the first Linear's backward hook says so
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            workload.loss_fn(model, batch).backward()
    finally:
        for handle in handles:
            handle.remove()
    # counted in a pass of their own: the hooks' quantised GEMMs are not the step's
    counter = FlopCounterMode(display=False)
    with counter:
        workload.loss_fn(model, batch).backward()
    found.step_flops = float(counter.get_total_flops())
    found.sqnr_db = {n: min(v) for n, v in operands.items() if v}
    return found
