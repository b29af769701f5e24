"""Block-scaled formats (MXFP8, NVFP4) emulated in plain PyTorch, for any device.

A block format stores a few bits per element and one shared scale per block of consecutive
elements along a matmul's reduction dimension:

* **MXFP8** (OCP Microscaling): 32-element blocks, e4m3 elements, a power-of-two (e8m0) scale
  per block. The scale is NVIDIA's RCEIL rule (cuBLAS "D block quantization": the scale is the
  power of two at or above ``amax / 448``), as torchao's MXFP8 training recipe uses.
* **NVFP4**: 16-element blocks, e2m1 elements (0, 0.5, 1, 1.5, 2, 3, 4, 6), an e4m3 scale per block
  and an fp32 scale per tensor (``amax / (448 * 6)``), the two-level scaling of torchao's
  ``nvfp4_quantize``. NVIDIA's training recipe adds three things this module emulates too:
  16x16 weight blocks (so a weight and its transpose quantise alike), stochastic rounding of
  gradients, and a random Hadamard transform over the weight-gradient GEMM's reduction dimension.

:func:`quantize` returns the dequantised values in fp32: what a block-scaled GEMM multiplies, since
the tensor cores accumulate the exact products in fp32. ``tests/policy/test_blockscale.py``
holds the round-to-nearest paths to torchao's emulated kernels bit for bit.

:class:`BlockLinear` runs a Linear's three training GEMMs (forward, input gradient "dgrad", weight
gradient "wgrad") in a block format, each direction separately, so a precision map can keep one
direction of one layer in bf16.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)  # 2**-6, torchao's floor on an NVFP4 block scale
E2M1_MAX = 6.0
_E8M0_BIAS = 127

DIRECTIONS: tuple[str, ...] = ("forward", "dgrad", "wgrad")
"""A Linear's three training GEMMs: output = x W^T, grad_x = dy W, grad_W = dy^T x."""


@dataclass(frozen=True)
class BlockFormat:
    """One block-scaled training recipe.

    Attributes:
        name: the policy's name ("mxfp8", "nvfp4").
        element: the element format, a :data:`mixprec.numerics.limits.FORMATS` name.
        block: elements per scale, along the reduction dimension.
        weight_tiles: the weight is scaled per ``block x block`` tile (NVFP4's 16x16), so the forward
            and the dgrad GEMM see the same quantised weight; False: 1-D blocks in each direction.
        stochastic_gradients: gradients (dgrad's and wgrad's dy) round stochastically.
        hadamard_wgrad: a random 16-point Hadamard transform over wgrad's reduction dimension
            (tokens) spreads outliers before quantising; exact in exact arithmetic.
    """

    name: str
    element: str
    block: int
    weight_tiles: bool = False
    stochastic_gradients: bool = False
    hadamard_wgrad: bool = False


MXFP8 = BlockFormat("mxfp8", "fp8_e4m3", 32)
NVFP4 = BlockFormat(
    "nvfp4", "fp4_e2m1", 16, weight_tiles=True, stochastic_gradients=True, hadamard_wgrad=True
)
BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (MXFP8, NVFP4)}


# ---------------------------------------------------------------------------- element rounding
def round_e2m1(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (fp32, already within +-6) on the e2m1 grid: round-to-nearest-even, or stochastic
    rounding when ``noise`` (uniform in [0, 1), x's shape) is given. The grid's spacing is 0.5 below
    2, 1 below 4 and 2 up to 6; a value rounded up to a binade's end lands on the next binade's
    first point, which is on the grid too."""
    mag = x.abs()
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    units = mag / step  # exact: step is a power of two
    units = torch.round(units) if noise is None else torch.floor(units + noise)
    return torch.copysign(torch.clamp(units * step, max=E2M1_MAX), x)


def _pad_last(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``x`` with its last dimension zero-padded to a multiple of ``block`` (zeros change no block's
    amax: what a kernel that pads its tiles computes), and the original length."""
    n = x.shape[-1]
    pad = (-n) % block
    return (nn.functional.pad(x, (0, pad)) if pad else x), n


def mx_quantize(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP8 (e4m3, RCEIL e8m0 scales) along the last dimension, dequantised to fp32."""
    x, n = _pad_last(x.float(), block)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    descale = amax / E4M3_MAX
    exponent = torch.where(
        torch.isnan(descale),
        255,
        torch.where(
            torch.isinf(descale),
            254,
            (torch.clamp(torch.ceil(torch.log2(descale)), min=-_E8M0_BIAS, max=_E8M0_BIAS) + _E8M0_BIAS).to(
                torch.uint8
            ),
        ),
    )
    # torchao's _to_mx_rceil: multiply by the reciprocal power of two (exact), saturate, cast
    reciprocal = torch.where(
        exponent == 255,
        descale,
        torch.where(
            exponent == 254,
            2.0**-127,
            torch.where(exponent == 0, 1.0, torch.exp2(_E8M0_BIAS - exponent.to(torch.float32))),
        ),
    )
    elements = torch.clamp(blocks * reciprocal, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    # torchao's get_fp_scale: 2**(e - 127), NaN for the NaN exponent
    two = torch.full_like(exponent, 2.0, dtype=torch.float32)
    scale = torch.pow(two, exponent.to(torch.int16) - _E8M0_BIAS)
    scale = torch.where(exponent != 255, scale, float("nan"))
    out = (elements * scale).reshape(x.shape)
    return out[..., :n]


def nvfp4_quantize(
    x: torch.Tensor,
    block: int = 16,
    *,
    tiles: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """NVFP4 (e2m1 elements, e4m3 block scales, an fp32 tensor scale) along the last dimension,
    dequantised to fp32. ``tiles``: one scale per ``block x block`` tile of a 2-D tensor instead of
    per 1-D block. ``generator``: round the elements stochastically with it (round-to-nearest-even
    without). The arithmetic is torchao's ``nvfp4_quantize`` and ``NVFP4Tensor.dequantize``."""
    x, n = _pad_last(x.float(), block)
    if x.numel() == 0:  # an expert that got no tokens
        return x[..., :n]
    amax = x.abs().amax()
    if not bool(amax > 0) or not bool(torch.isfinite(amax)):
        # all zeros: zeros (torchao's scale would divide 0 by 0); non-finite: propagate as a cast would
        return x[..., :n] * (0.0 if bool(amax == 0) else float("nan"))
    tensor_scale = amax / (E4M3_MAX * E2M1_MAX)
    if tiles:
        if x.dim() != 2:
            raise ValueError(f"16x16 tiles need a 2-D weight, got shape {tuple(x.shape)}")
        rows_pad = (-x.shape[0]) % block
        xt = nn.functional.pad(x, (0, 0, 0, rows_pad)) if rows_pad else x
        r, c = xt.shape[0] // block, xt.shape[1] // block
        tile_amax = xt.reshape(r, block, c, block).abs().amax(dim=(1, 3))
        block_amax = tile_amax.repeat_interleave(block, 0)[: x.shape[0]].unsqueeze(-1)
    else:
        block_amax = None
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    block_amax = blocks.abs().amax(-1) if block_amax is None else block_amax.squeeze(-1)
    block_scale = (block_amax / E2M1_MAX) / tensor_scale
    block_scale = torch.clamp(block_scale, min=E4M3_TINY, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    reciprocal = (1.0 / tensor_scale) / block_scale
    scaled = torch.clamp(blocks * reciprocal.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    noise = None
    if generator is not None:
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=torch.float32)
    elements = round_e2m1(scaled, noise)
    out = (elements * (tensor_scale * block_scale).unsqueeze(-1)).reshape(x.shape)
    return out[..., :n]


def quantize(
    x: torch.Tensor,
    fmt: BlockFormat,
    *,
    tiles: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``x`` in ``fmt`` along its last dimension, dequantised to fp32."""
    if fmt.element == "fp8_e4m3":
        return mx_quantize(x, fmt.block)
    return nvfp4_quantize(x, fmt.block, tiles=tiles, generator=generator)


# ---------------------------------------------------------------------------- Hadamard transform
def _hadamard16(signs: torch.Tensor) -> torch.Tensor:
    """An orthogonal 16x16 matrix: Sylvester's Hadamard matrix times diag(signs), over 4, on the
    signs' device (the layer draws them on its input's)."""
    h = torch.ones(1, 1, device=signs.device)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * signs.to(h.dtype)) / 4.0


def hadamard_rows(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``Q^T x`` for the block-diagonal orthogonal ``Q`` of 16x16 Hadamard blocks over x's first
    dimension (a multiple of 16): applied to both operands of a GEMM that reduces over that
    dimension it cancels (``(Q^T a)^T (Q^T b) = a^T b``)."""
    h = _hadamard16(signs).to(x.device, x.dtype)
    m = x.shape[0]
    return (h.t() @ x.reshape(m // 16, 16, -1)).reshape(x.shape)


# ---------------------------------------------------------------------------- the Linear
def _high(x: torch.Tensor) -> torch.Tensor:
    """A GEMM operand kept in bf16 (what autocast gives the Linear it leaves alone), in fp32."""
    return x.to(torch.bfloat16).float()


class _BlockMatmul(torch.autograd.Function):
    """``x @ w.T`` (x 2-D) with each of the three GEMMs in ``fmt`` or in bf16, fp32 accumulation."""

    @staticmethod
    def forward(ctx, x, w, fmt, low, generator, signs):
        ctx.save_for_backward(x, w)
        ctx.fmt, ctx.low, ctx.generator, ctx.signs = fmt, low, generator, signs
        if "forward" in low:
            xq = quantize(x, fmt)
            wq = quantize(w, fmt, tiles=fmt.weight_tiles)
        else:
            xq, wq = _high(x), _high(w)
        return xq @ wq.t()

    @staticmethod
    @once_differentiable  # the emulated quantisation has no second derivative to offer
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        fmt, low, gen = ctx.fmt, ctx.low, ctx.generator
        dy = dy.float().contiguous()
        sr = gen if fmt.stochastic_gradients else None
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            if "dgrad" in low:  # reduces over the output features
                dyq = quantize(dy, fmt, generator=sr)
                # tiles are symmetric, so W^T's tiles are W's
                wq_t = quantize(w.t().contiguous(), fmt, tiles=fmt.weight_tiles)
            else:
                dyq, wq_t = _high(dy), _high(w.t().contiguous())
            grad_x = (dyq @ wq_t.t()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            if "wgrad" in low:  # reduces over the tokens
                a, b = dy, x.float()
                if fmt.hadamard_wgrad and ctx.signs is not None and a.shape[0] and a.shape[0] % 16 == 0:
                    a, b = hadamard_rows(a, ctx.signs), hadamard_rows(b, ctx.signs)
                dyq_t = quantize(a.t().contiguous(), fmt, generator=sr)
                xq_t = quantize(b.t().contiguous(), fmt)
            else:
                dyq_t, xq_t = _high(dy.t().contiguous()), _high(x.float().t().contiguous())
            grad_w = (dyq_t @ xq_t.t()).to(w.dtype)
        return grad_x, grad_w, None, None, None, None


class BlockLinear(nn.Linear):
    """An ``nn.Linear`` whose training GEMMs run in a block format (emulated), the rest as autocast
    would run it. ``low`` names the GEMM directions (of :data:`DIRECTIONS`) in the format; the
    others run with bf16 operands. The parameters are the original Linear's own objects, so
    optimizers, ties and state dicts are unchanged."""

    def __init__(self, linear: nn.Linear, fmt: BlockFormat, low: frozenset[str], seed: int = 0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.fmt, self.low, self.seed = fmt, frozenset(low), seed
        self._generator: torch.Generator | None = None
        self._signs: torch.Tensor | None = None

    def _randomness(self, device: torch.device) -> tuple[torch.Generator | None, torch.Tensor | None]:
        """A generator of the layer's own (so stochastic rounding leaves the global RNG, which the
        fp32 reference shares, untouched) and the Hadamard signs drawn from it once."""
        if not (self.fmt.stochastic_gradients or self.fmt.hadamard_wgrad):
            return None, None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
            coin = torch.randint(0, 2, (16,), generator=self._generator, device=device)
            self._signs = (coin * 2 - 1).float()
        return self._generator, self._signs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        generator, signs = self._randomness(x.device)
        with torch.autocast(device, enabled=False):
            flat = x.reshape(-1, x.shape[-1]).float()
            out = _BlockMatmul.apply(flat, self.weight, self.fmt, self.low, generator, signs)
            out = out.reshape(*x.shape[:-1], self.out_features).to(out_dtype)
        if self.bias is not None:
            out = out + self.bias.to(out_dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.fmt.name}, low={sorted(self.low)}"


def eligible(module: nn.Module, fmt: BlockFormat) -> bool:
    """A plain Linear whose both matmul dimensions hold whole blocks (the kernels' constraint)."""
    return (
        type(module) is nn.Linear
        and module.in_features % fmt.block == 0
        and module.out_features % fmt.block == 0
    )


def seed_of(name: str) -> int:
    """A stable per-layer seed from its name (Python's hash() of a str is salted per process; a
    CRC tells 'layers.12' from 'layers.21', which a sum or product of characters would not)."""
    return zlib.crc32(name.encode())
