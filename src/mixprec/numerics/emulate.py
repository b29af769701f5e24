"""Run matmul-like ops in fp32 but with the numerics of a low-precision format, on any device.

``with emulate("bf16"):`` rounds the operands of linear layers, convolutions, matmuls and
scaled-dot-product attention to the format before the op and (for fp16/bf16) its result after it,
which is what CPU/CUDA autocast does: low-precision operands, fp32 accumulation, low-precision result.
Gradients are emulated too, so a backward pass inside the block sees low-precision gradients.

Per format (forward operands / forward result / gradients):

* "bf16", "fp16": operands rounded, result rounded, every gradient into and out of the op rounded
  (autocast's backward matmuls run in the low dtype as well).
* "tf32": operands rounded to TF32 (10-bit mantissa, fp32 range, round-to-nearest-even, as cuBLAS
  does to TF32 inputs), result stays fp32; in backward the incoming gradient is rounded to TF32 (it is
  an operand of the backward matmuls) and the gradients they produce stay fp32.
* "fp8_e4m3", "fp8_e5m2": operands quantised to the format, result stays fp32 and so do the
  gradients the backward matmuls produce, the incoming gradient is quantised to fp8_e5m2. With
  ``scaled_fp8=True`` (default) every quantisation uses dynamic per-tensor scaling
  (:func:`~mixprec.numerics.formats.quantize_scaled`), mirroring torchao's ``Float8Linear`` default
  "tensorwise" recipe, which also returns high-precision outputs; with ``scaled_fp8=False`` values
  are cast unscaled (small values underflow, e4m3 saturates at ±448, e5m2 overflows to inf).
* "fp32": nothing changes.

Intercepted: ``F.linear``, ``F.conv{1,2,3}d``, ``F.conv_transpose{1,2,3}d``, ``torch.matmul``/``mm``/
``bmm``/``addmm``/``baddbmm`` and their Tensor-method forms including ``@``, and
``F.scaled_dot_product_attention`` (query, key and value only; an additive float mask is left as is).
All floating-point tensor arguments of the other ops are rounded (bias included, as autocast casts it
too). Emulated ops compute in fp32, so their results are fp32 tensors. When a call passes ``out=``,
its operands are rounded but its result is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mixprec.errors import UsageError, did_you_mean
from mixprec.numerics.formats import quantize_scaled, round_to
from mixprec.numerics.limits import FORMATS

__all__ = ["EmulationMode", "emulate"]

_FP8 = ("fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class _Plan:
    fmt: str  # operand format
    grad_fmt: str  # gradient format
    round_output: bool  # forward result rounded to fmt (and so are the gradients the op produces)
    scaled: bool  # per-tensor scaled quantisation (fp8 only)


def _quantize(x: torch.Tensor, fmt: str, scaled: bool) -> torch.Tensor:
    return quantize_scaled(x, fmt) if scaled else round_to(x, fmt)


class _Round(torch.autograd.Function):
    """Forward: quantise to ``fwd_fmt`` (None: copy). Backward: quantise the gradient to ``bwd_fmt``."""

    @staticmethod
    def forward(ctx, x, fwd_fmt, bwd_fmt, scaled):
        ctx.bwd_fmt = bwd_fmt
        ctx.scaled = scaled
        ctx.in_dtype = x.dtype
        if fwd_fmt is None:
            return x.detach().clone()
        return _quantize(x, fwd_fmt, scaled)

    @staticmethod
    def backward(ctx, grad):
        if ctx.bwd_fmt is not None and grad is not None:
            grad = _quantize(grad, ctx.bwd_fmt, ctx.scaled)
        return (grad.to(ctx.in_dtype) if grad is not None else None), None, None, None


def _round(x: torch.Tensor, fwd_fmt: str | None, bwd_fmt: str | None, scaled: bool) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _Round.apply(x, fwd_fmt, bwd_fmt, scaled)
    if fwd_fmt is None:
        return x
    return _quantize(x, fwd_fmt, scaled)


def _is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


_SDPA_QKV = ("query", "key", "value")

_OPS: set[Any] = {
    F.linear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    torch.Tensor.matmul,
    torch.Tensor.mm,
    torch.Tensor.bmm,
    torch.Tensor.addmm,
    torch.Tensor.baddbmm,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
}


class EmulationMode(TorchFunctionMode):
    """The torch-function mode behind :func:`emulate`; use it through ``emulate``."""

    def __init__(self, plan: _Plan | None) -> None:
        super().__init__()
        self._plan = plan

    def _in(self, x: Any) -> Any:
        plan = self._plan
        if plan is None or not _is_float_tensor(x):
            return x
        return _round(x, plan.fmt, plan.grad_fmt if plan.round_output else None, plan.scaled)

    def _out(self, y: Any) -> Any:
        plan = self._plan
        if plan is None or not _is_float_tensor(y):
            return y
        return _round(y, plan.fmt if plan.round_output else None, plan.grad_fmt, plan.scaled)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if self._plan is None:
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            args = tuple(self._in(a) if i < 3 else a for i, a in enumerate(args))
            kwargs = {k: (self._in(v) if k in _SDPA_QKV else v) for k, v in kwargs.items()}
        elif func in _OPS:
            args = tuple(self._in(a) for a in args)
            kwargs = {k: (v if k == "out" else self._in(v)) for k, v in kwargs.items()}
        else:
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if kwargs.get("out") is not None:
            return result
        return self._out(result)


def emulate(fmt: str, *, scaled_fp8: bool = True) -> EmulationMode:
    """Context manager: matmul-like ops inside behave numerically as if run in ``fmt``, computing in fp32.

    ``fmt`` is one of "fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2" (see the module docstring
    for what is rounded where). ``scaled_fp8`` selects per-tensor scaled fp8 quantisation (default,
    the usual fp8 training recipe) or plain casts; it is ignored for the other formats. The mode is
    removed when the block exits, also on an exception, and blocks nest (inner format applied first).
    """
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise UsageError(
            f"emulate() got unknown format {fmt!r}; valid formats are {', '.join(FORMATS)}."
            f"{did_you_mean(str(fmt), FORMATS)} Pass one of those names."
        )
    if fmt == "fp32":
        return EmulationMode(None)
    if fmt in _FP8:
        plan = _Plan(fmt=fmt, grad_fmt="fp8_e5m2", round_output=False, scaled=bool(scaled_fp8))
    elif fmt == "tf32":
        plan = _Plan(fmt=fmt, grad_fmt=fmt, round_output=False, scaled=False)
    else:
        plan = _Plan(fmt=fmt, grad_fmt=fmt, round_output=True, scaled=False)
    return EmulationMode(plan)


def emulation_context(fmt: str | None) -> Callable[[], EmulationMode] | None:
    """The context that rounds every matmul/conv to ``fmt`` (``Candidate.emulate``), or None."""
    if fmt is None:
        return None
    return lambda: emulate(fmt)
