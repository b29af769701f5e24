"""The numbers that define each floating-point format mixprec reasons about.

Taken from ``torch.finfo`` where PyTorch has the dtype, so they cannot drift from what a cast
really does; TF32 (no PyTorch dtype) is fp32's exponent range with a 10-bit mantissa.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FormatLimits:
    name: str
    exponent_bits: int
    mantissa_bits: int  # explicit fraction bits
    max_finite: float
    smallest_normal: float
    smallest_subnormal: float
    has_inf: bool
    dtype: torch.dtype | None  # the PyTorch dtype, when there is one

    @property
    def eps(self) -> float:
        """Spacing of representable numbers just above 1.0."""
        return 2.0**-self.mantissa_bits


def _from_finfo(name: str, dtype: torch.dtype, exponent_bits: int, has_inf: bool) -> FormatLimits:
    fi = torch.finfo(dtype)
    return FormatLimits(
        name=name,
        exponent_bits=exponent_bits,
        mantissa_bits=fi.nmant if hasattr(fi, "nmant") else round(-torch.log2(torch.tensor(fi.eps)).item()),
        max_finite=float(fi.max),
        smallest_normal=float(fi.smallest_normal),
        smallest_subnormal=float(fi.smallest_normal) * float(fi.eps),
        has_inf=has_inf,
        dtype=dtype,
    )


FORMATS: dict[str, FormatLimits] = {
    "fp32": _from_finfo("fp32", torch.float32, 8, True),
    "tf32": FormatLimits(
        name="tf32",
        exponent_bits=8,
        mantissa_bits=10,
        max_finite=(2.0 - 2.0**-10) * 2.0**127,  # fp32's exponent range, 10-bit mantissa
        smallest_normal=float(torch.finfo(torch.float32).smallest_normal),
        smallest_subnormal=float(torch.finfo(torch.float32).smallest_normal) * 2.0**-10,
        has_inf=True,
        dtype=None,
    ),
    "bf16": _from_finfo("bf16", torch.bfloat16, 8, True),
    "fp16": _from_finfo("fp16", torch.float16, 5, True),
    "fp8_e4m3": _from_finfo("fp8_e4m3", torch.float8_e4m3fn, 4, False),
    "fp8_e5m2": _from_finfo("fp8_e5m2", torch.float8_e5m2, 5, True),
    # NVFP4's element (torch.float4_e2m1fn_x2 packs two and casts to nothing): 0, 0.5 ... 4, 6
    "fp4_e2m1": FormatLimits(
        name="fp4_e2m1",
        exponent_bits=2,
        mantissa_bits=1,
        max_finite=6.0,
        smallest_normal=1.0,
        smallest_subnormal=0.5,
        has_inf=False,
        dtype=None,
    ),
}

LOW_PRECISION_FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
