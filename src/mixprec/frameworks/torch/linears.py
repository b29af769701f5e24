"""The Linear layers of a torch workload as a low-format policy sees them: each one's GEMM shapes,
its share of the training step's FLOPs, and how much of its operands the format's quantisation
loses, all from one fp32 forward and backward on a copy of the model."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
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
    refused: Linear name -> why the format's kernels cannot take it, and the fix
        (:func:`mixprec.policy.lowformat.refusal`): what a check names when none ran.
    tied: Linear layers whose weight an embedding shares (an LM head): the field keeps them in bf16.
    """

    shapes: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    directions: dict[str, frozenset[str]] = field(default_factory=dict)
    step_flops: float = 0.0
    sqnr_db: dict[str, float] = field(default_factory=dict)
    flops: dict[str, dict[str, float]] = field(default_factory=dict)
    """Linear name -> direction -> FLOPs of that GEMM over all the layer's calls in the step."""
    refused: dict[str, str] = field(default_factory=dict)
    tied: list[str] = field(default_factory=list)

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

    def to_dict(self) -> dict[str, Any]:
        """As plain data (a script's census crosses processes as JSON)."""
        return {
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "shapes": {n: list(s) for n, s in self.shapes.items()},
            "directions": {n: sorted(d) for n, d in self.directions.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinearCensus:
        found = cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
        found.shapes = {n: (int(s[0]), int(s[1]), int(s[2])) for n, s in found.shapes.items()}
        found.directions = {n: frozenset(d) for n, d in found.directions.items()}
        return found


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


class Recorder:
    """The census's hooks on a live model: every call of each Linear ``spec`` would convert (fp32
    islands, ``keep_fp32``, left out: they run in fp32) recorded into :attr:`found` while installed.
    ``quiet``: a context the hooks' own quantised GEMMs run in (a FLOP counter of the step, paused),
    where something counts what the step computes around them."""

    def __init__(
        self,
        model: nn.Module,
        spec: PolicySpec,
        keep_fp32: Sequence[str] = (),
        quiet: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.model, self.spec, self.quiet = model, spec, quiet
        self.plan = plan_layers(model, spec, keep_fp32)
        self.found = LinearCensus(refused=dict(self.plan.refused), tied=tied_linears(model))
        self.operands: dict[str, list[float]] = {}
        self.saved: dict[str, list[torch.Tensor]] = {}  # per layer, a stack: a layer may run several times
        self.handles: list[Any] = []

    def install(self) -> None:
        modules = dict(self.model.named_modules())
        self.handles = [modules[name].register_forward_hook(self._forward(name)) for name in self.plan.low]

    def remove(self) -> LinearCensus:
        """The hooks off; what they recorded (its ``step_flops`` the caller's to count)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.found.sqnr_db = {n: min(v) for n, v in self.operands.items() if v}
        return self.found

    def _forward(self, name: str) -> Any:
        spec = self.spec

        def hook(module: nn.Linear, args: tuple, output: Any) -> None:
            x = args[0].detach().reshape(-1, module.in_features).float()
            w = module.weight.detach().float()
            grads = torch.is_grad_enabled()  # a teacher under no_grad runs its forward only
            self.found.add_call(
                name,
                x.shape[0],
                module.in_features,
                module.out_features,
                ["forward"]
                + (["dgrad"] if grads and args[0].requires_grad else [])
                + (["wgrad"] if grads and module.weight.requires_grad else []),
            )
            with self.quiet():
                self.operands.setdefault(name, []).append(_gemm_sqnr(x, w, spec, b_is_weight=True))
            if isinstance(output, torch.Tensor) and output.requires_grad:
                # a hook on the output tensor, not a module backward hook: those break on an in-place
                # op after the layer (ReLU(inplace=True), h += x), as frameworks/torch/ranges.py says
                self.saved.setdefault(name, []).append(x)
                output.register_hook(self._backward(name, module, args[0].requires_grad))

        return hook

    def _backward(self, name: str, module: nn.Linear, dgrad: bool) -> Any:
        spec = self.spec

        def hook(dy: torch.Tensor) -> None:
            if not self.saved.get(name):
                return
            x, w = self.saved[name].pop(), module.weight.detach().float()
            dy = dy.detach().reshape(-1, module.out_features).float()
            with self.quiet():
                if dgrad:  # dy @ W: reduces over the out features
                    self.operands[name].append(_gemm_sqnr(dy, w.t(), spec, b_is_weight=True, a_is_grad=True))
                if module.weight.requires_grad:  # dy^T @ x: reduces over the tokens
                    self.operands[name].append(_gemm_sqnr(dy.t(), x.t(), spec, a_is_grad=True))

        return hook


def tied_linears(model: nn.Module) -> list[str]:
    """The Linear layers whose weight an embedding shares (an LM head tied to its token embedding)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m.weight) in embedded]


def census(
    workload: Workload, spec: PolicySpec, batch: Any, device: str, keep_fp32: Sequence[str] = ()
) -> LinearCensus:
    """Shapes, FLOPs and quantised-GEMM SQNRs of the Linear layers ``spec`` would convert (fp32
    islands, ``keep_fp32``, left out: they run in fp32)."""
    model = copy.deepcopy(workload.model).to(device)
    recorder = Recorder(model, spec, keep_fp32)
    recorder.install()
    try:
        workload.loss_fn(model, batch).backward()
    finally:
        found = recorder.remove()
    # counted in a pass of their own: the hooks' quantised GEMMs are not the step's
    found.step_flops = float(count_flops(lambda: workload.loss_fn(model, batch).backward()))
    return found
