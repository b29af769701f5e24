"""The Linear layers of a torch workload as a low-format policy sees them: each one's GEMM shapes,
its share of the training step's FLOPs, and how much of its operands the format's quantisation
loses, all from one fp32 forward and backward on a copy of the model."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.frameworks.torch.flops import count_flops
from mixprec.numerics.formats import quantize_scaled
from mixprec.policy.blockscale import BLOCK_FORMATS, E4M3_MAX, quantize
from mixprec.policy.lowformat import plan_layers
from mixprec.policy.registry import PolicySpec
from mixprec.workload import Workload


@dataclass
class LinearCensus:
    """Attributes:
    shapes: Linear name -> (M tokens over all its calls in the step, K in features, N out features)
        at the checked batch.
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
    flops: dict[str, dict[str, float]] = field(default_factory=dict)
    """Linear name -> direction -> FLOPs of that GEMM over all the layer's calls in the step."""

    def add_call(self, name: str, m: int, k: int, n: int, directions: Sequence[str]) -> None:
        """One call of the layer over ``m`` tokens, running ``directions``."""
        total = self.shapes[name][0] if name in self.shapes else 0
        self.shapes[name] = (total + m, k, n)
        self.directions[name] = self.directions.get(name, frozenset()) | frozenset(directions)
        per = self.flops.setdefault(name, {})
        for direction in directions:
            per[direction] = per.get(direction, 0.0) + 2.0 * m * k * n

    def low_share(self, low: dict[str, frozenset[str]]) -> float:
        """The share of the step's FLOPs in GEMMs the format runs (``low``: a LayerPlan's)."""
        done = sum(f for n, dirs in low.items() for d, f in self.flops.get(n, {}).items() if d in dirs)
        return done / self.step_flops if self.step_flops else 0.0


def _sqnr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    noise = (x - q).double().pow(2).sum().item()
    signal = x.double().pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _quantized(x: torch.Tensor, spec: PolicySpec, weight: bool = False, grad: bool = False) -> torch.Tensor:
    """``x`` (2-D, reduction dimension last) as the format stores it for a GEMM, dequantised to fp32
    (round-to-nearest: the census leaves out NVFP4's stochastic rounding and Hadamard transform).
    fp8 follows torchao's recipes: tensorwise casts gradients to e5m2, rowwise rounds its per-row
    scales down to powers of two."""
    x = x.float().contiguous()
    if spec.block_format is not None:
        fmt = BLOCK_FORMATS[spec.block_format]
        return quantize(x, fmt, tiles=weight and fmt.weight_tiles)
    if spec.fp8_recipe == "rowwise":
        amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))  # a power of two, at most max/amax
        return quantize_scaled(x, "fp8_e4m3", E4M3_MAX / scale)
    return quantize_scaled(x, "fp8_e5m2" if grad else "fp8_e4m3")


def _gemm_sqnr(
    a: torch.Tensor, b: torch.Tensor, spec: PolicySpec, b_is_weight: bool = False, a_is_grad: bool = False
) -> float:
    """SQNR of ``a @ b.T`` (both with the reduction dimension last) with quantised operands."""
    exact = a.float() @ b.float().t()
    return _sqnr_db(exact, _quantized(a, spec, grad=a_is_grad) @ _quantized(b, spec, b_is_weight).t())


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

    saved: dict[str, list[torch.Tensor]] = {}  # per layer, a stack: a layer may run several times

    def forward_hook(name: str) -> Any:
        def hook(module: nn.Linear, args: tuple, output: Any) -> None:
            x = args[0].detach().reshape(-1, module.in_features).float()
            w = module.weight.detach().float()
            grads = torch.is_grad_enabled()  # a teacher under no_grad runs its forward only
            found.add_call(
                name,
                x.shape[0],
                module.in_features,
                module.out_features,
                ["forward"]
                + (["dgrad"] if grads and args[0].requires_grad else [])
                + (["wgrad"] if grads and module.weight.requires_grad else []),
            )
            operands.setdefault(name, []).append(_gemm_sqnr(x, w, spec, b_is_weight=True))
            if isinstance(output, torch.Tensor) and output.requires_grad:
                # a hook on the output tensor, not a module backward hook: those break on an in-place
                # op after the layer (ReLU(inplace=True), h += x), as frameworks/torch/ranges.py says
                saved.setdefault(name, []).append(x)
                output.register_hook(backward_hook(name, module, args[0].requires_grad))

        return hook

    def backward_hook(name: str, module: nn.Linear, dgrad: bool) -> Any:
        def hook(dy: torch.Tensor) -> None:
            if not saved.get(name):
                return
            x, w = saved[name].pop(), module.weight.detach().float()
            dy = dy.detach().reshape(-1, module.out_features).float()
            if dgrad:  # dy @ W: reduces over the out features
                operands[name].append(_gemm_sqnr(dy, w.t(), spec, b_is_weight=True, a_is_grad=True))
            if module.weight.requires_grad:  # dy^T @ x: reduces over the tokens
                operands[name].append(_gemm_sqnr(dy.t(), x.t(), spec, a_is_grad=True))

        return hook

    handles = [modules[name].register_forward_hook(forward_hook(name)) for name in plan.low]
    try:
        workload.loss_fn(model, batch).backward()
    finally:
        for handle in handles:
            handle.remove()
    # counted in a pass of their own: the hooks' quantised GEMMs are not the step's
    found.step_flops = float(count_flops(lambda: workload.loss_fn(model, batch).backward()))
    found.sqnr_db = {n: min(v) for n, v in operands.items() if v}
    return found
