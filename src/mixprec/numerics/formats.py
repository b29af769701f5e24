"""Reference rounding of fp32 values onto every format mixprec reasons about.

``round_to`` works on the fp32 bit pattern with integer arithmetic only, so it runs on any device and
covers TF32, which has no PyTorch dtype. For the formats PyTorch does have it is bit-for-bit what
``x.to(dtype).float()`` gives (the test suite proves it), including PyTorch's choices where IEEE
leaves room:

* round-to-nearest, ties-to-even; subnormals of the target format are produced, never flushed;
* fp16, bf16, tf32, fp8_e5m2: a value whose rounded magnitude exceeds the largest finite number
  becomes ±inf, and ±inf stays ±inf;
* fp8_e4m3 (``torch.float8_e4m3fn``, no infinity): PyTorch saturates, so finite overflow *and* ±inf
  become ±448 (the largest finite value); only NaN maps to NaN;
* NaN stays NaN (its fp32 bits are passed through), signed zeros keep their sign.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from mixprec.errors import UsageError, did_you_mean
from mixprec.numerics.limits import FORMATS

__all__ = ["quantize_scaled", "round_to"]

_FP32_MANTISSA_BITS = 23
_FP32_BIAS = 127
_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_SIGN_MASK = -0x80000000  # 0x80000000 as a signed int32
_AMAX_EPS = 1e-12  # torchao's floor on amax before computing a scale


@dataclass(frozen=True)
class _Rounding:
    mantissa_bits: int
    min_normal_biased_exp: int  # the format's smallest normal exponent, in fp32's biased encoding
    max_finite_bits: int  # fp32 bit pattern of the format's largest finite value
    has_inf: bool


def _fp32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _rounding(fmt: str) -> _Rounding | None:
    """Rounding parameters for ``fmt``; None for fp32 (identity). UsageError for unknown names."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise UsageError(
            f"Unknown number format {fmt!r}; valid formats are {', '.join(FORMATS)}."
            f"{did_you_mean(str(fmt), FORMATS)} Pass one of those names."
        )
    if fmt == "fp32":
        return None
    lim = FORMATS[fmt]
    return _Rounding(
        mantissa_bits=lim.mantissa_bits,
        min_normal_biased_exp=round(math.log2(lim.smallest_normal)) + _FP32_BIAS,
        max_finite_bits=_fp32_bits(lim.max_finite),
        has_inf=lim.has_inf,
    )


def _as_fp32(x: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise UsageError(
            f"{what} expects a torch.Tensor, got {type(x).__name__}; pass a floating-point tensor."
        )
    if not x.is_floating_point():
        raise UsageError(
            f"{what} expects a floating-point tensor, got dtype {x.dtype}; "
            "convert it with .float() first (valid inputs: fp32, fp16, bf16, fp64, fp8)."
        )
    return x.detach().to(torch.float32)


def round_to(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round ``x`` to the nearest value representable in ``fmt`` and return it as a new fp32 tensor.

    ``fmt`` is one of ``mixprec.numerics.limits.FORMATS`` ("fp32" is the identity, returned as a copy).
    fp16/bf16/fp8 inputs are widened to fp32 exactly first. fp64 inputs are first rounded to fp32 and
    then to ``fmt`` (double rounding): the result is what ``x.float().to(dtype)`` gives, which can
    differ from a direct fp64 -> ``fmt`` rounding for values within half an fp32 ulp of a tie.

    The result carries no autograd history (use :func:`mixprec.numerics.emulate.emulate` for
    differentiable emulation). Behaviour at the edges is documented in the module docstring.
    """
    spec = _rounding(fmt)
    x = _as_fp32(x, "round_to")
    if spec is None:
        return x.clone()

    bits = x.view(torch.int32)
    sign = bits & _SIGN_MASK
    mag = bits & _ABS_MASK
    finite = mag < _INF_BITS
    mag_f = torch.where(finite, mag, 0)

    # value = significand * 2**(exp_eff - 150); fp32 subnormals have exponent field 0, no hidden bit.
    exp = mag_f >> _FP32_MANTISSA_BITS
    exp_eff = exp.clamp(min=1)
    mantissa = mag_f & 0x7FFFFF
    significand = torch.where(exp > 0, mantissa | 0x800000, mantissa)

    # Low significand bits to drop: fixed above the format's normal range, more below it (subnormals).
    # Beyond 25 every significand (< 2**24) is below half a quantum, so 25 is as good as any larger shift.
    shift = (_FP32_MANTISSA_BITS - spec.mantissa_bits) + (spec.min_normal_biased_exp - exp_eff).clamp(min=0)
    shift = shift.clamp(max=25)
    kept = significand >> shift
    remainder = significand - (kept << shift)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((kept & 1) == 1))
    kept = kept + round_up.to(torch.int32)

    # Back to an fp32 pattern. The rounded significand kept << shift is 0 or in [2**23, 2**24]; the
    # pattern is linear in it within the binade and a carry to 2**24 moves correctly to the next binade.
    result = ((exp_eff - 1) << _FP32_MANTISSA_BITS) + (kept << shift)
    result = torch.where(kept == 0, 0, result)

    overflow_to = _INF_BITS if spec.has_inf else spec.max_finite_bits
    result = torch.where(result > spec.max_finite_bits, overflow_to, result)
    result = torch.where(mag == _INF_BITS, overflow_to, result)
    result = torch.where(mag > _INF_BITS, mag, result)  # NaN: keep its bits
    return (result | sign).view(torch.float32)


def quantize_scaled(x: torch.Tensor, fmt: str, amax: float | torch.Tensor | None = None) -> torch.Tensor:
    """Per-tensor scaled quantisation as in fp8 training recipes, returned dequantised in fp32.

    ``scale = max_finite(fmt) / amax`` with ``amax = max(|x|)`` unless given (pass a stored amax to
    mimic delayed scaling); then ``round_to(clamp(x * scale, ±max_finite), fmt) / scale``. This mirrors
    per-tensor "tensorwise" dynamic scaling, the default recipe of torchao's ``Float8Linear``,
    including its saturating cast (values beyond the range after scaling clamp to ±max_finite, for
    fp8_e5m2 too) and its amax floor of 1e-12 (so an all-zero tensor stays zero). The scale is
    computed in fp32. When ``amax`` is NaN or infinite the tensor is quantised unscaled (scale 1).
    Intended for "fp8_e4m3" / "fp8_e5m2"; other formats work the same way.
    """
    spec_max = FORMATS[fmt].max_finite if _rounding(fmt) is not None else None
    x32 = _as_fp32(x, "quantize_scaled")
    if spec_max is None:
        return x32.clone()
    if x32.numel() == 0:
        return x32.clone()
    if amax is None:
        amax_t = x32.abs().amax()
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x32.device).detach().abs()
    scale = torch.tensor(spec_max, dtype=torch.float32, device=x32.device) / amax_t.clamp(min=_AMAX_EPS)
    scale = torch.where(torch.isfinite(amax_t), scale, 1.0)
    scaled = (x32 * scale).clamp(-spec_max, spec_max)
    return round_to(scaled, fmt) / scale
