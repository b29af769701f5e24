"""Block-scaled formats (MXFP8, NVFP4) emulated in plain PyTorch: the round-to-nearest paths bit
for bit against torchao's emulated kernels, e2m1 rounding (nearest-even and stochastic), NVFP4's
16x16 weight tiles, the Hadamard transform, and BlockLinear's GEMM directions, autocast and RNG."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from extras import require
from mixprec.policy import blockscale as bs
from mixprec.policy.blockscale import (
    DIRECTIONS,
    MXFP8,
    NVFP4,
    BlockLinear,
    hadamard_rows,
    mx_quantize,
    nvfp4_quantize,
    round_e2m1,
)

require("torchao", "fp8")  # fails, not skips, under make test (MIXPREC_REQUIRE_FRAMEWORKS=1)

from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402

from mixprec.policy.lowformat import torchao_block_linear  # noqa: E402

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
ALL = frozenset(DIRECTIONS)


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Small tensors: one thread is faster on a shared CPU, and matmuls are deterministic."""


def torchao_mx(x: torch.Tensor) -> torch.Tensor:
    return MXTensor.to_mx(
        x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL, KernelPreference.EMULATED
    ).dequantize(torch.float32)


def torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    scale = per_tensor_amax_to_scale(x.abs().amax())
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit for bit, NaN where the other is NaN (NaN != NaN otherwise)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.isnan(), b.isnan()), "NaNs in different places"
    assert torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)), (
        f"max difference {(torch.nan_to_num(a) - torch.nan_to_num(b)).abs().max()}"
    )


def samples(block: int) -> list[tuple[str, torch.Tensor]]:
    """Inputs that exercise every scale path: random shapes and magnitudes, per-row and per-block
    magnitudes from fp32's subnormals to near its max, zero rows and blocks, e4m3 boundaries."""
    g = torch.Generator().manual_seed(1234)
    out: list[tuple[str, torch.Tensor]] = []
    shapes = [(4, 32), (64, 128), (33, 96), (128, 256), (3 * 5, 64)]
    for shape in shapes:
        for scale in (1e-30, 1e-12, 1e-3, 1.0, 448.0, 1e8, 1e30):
            out.append((f"{shape[0]}x{shape[1]}*{scale:g}", torch.randn(shape, generator=g) * scale))
    rows = torch.randn(64, 128, generator=g) * torch.logspace(-38, 37, 64).unsqueeze(1)
    rows[5] = 0.0  # a zero row: every block's amax is 0
    rows[7, :block] = 0.0  # one zero block in an ordinary row
    out.append(("row-scales-1e-38..1e37-zero-blocks", rows))
    per_block = torch.randn(16, 8 * block, generator=g) * torch.logspace(-20, 20, 8).repeat_interleave(block)
    out.append(("per-block-scales", per_block))
    out.append(("fp32-subnormals", torch.randn(8, 64, generator=g) * 1e-42))
    bounds = torch.tensor([448.0, 464.0, 480.0, 240.0, 2**-6, 2**-9, 2**-10, 1.0625, 2.125, 449.0, 447.0])
    edge = torch.zeros(4, 32)
    edge[0, :11], edge[0, 11:22] = bounds, -bounds
    edge[1] = edge[0] * 3.0  # amax 1440: the block's scale is 4, elements land on halves of the grid
    edge[2] = edge[0] * 2.0**-130  # subnormal amax: the scale's exponent clamps at its minimum
    out.append(("e4m3-boundaries", edge))
    return out


MX_SAMPLES, NV_SAMPLES = samples(32), samples(16)


@pytest.mark.parametrize("x", [x for _, x in MX_SAMPLES], ids=[n for n, _ in MX_SAMPLES])
def test_mx_quantize_is_torchao_rceil_bit_for_bit(x):
    assert_bitwise(mx_quantize(x), torchao_mx(x.contiguous()))


def test_mx_quantize_is_torchao_on_bf16_3d_and_nonfinite_input():
    g = torch.Generator().manual_seed(5)
    x3 = torch.randn(3, 5, 64, generator=g)
    assert_bitwise(mx_quantize(x3), torchao_mx(x3.reshape(15, 64)).reshape(3, 5, 64))
    xb = torch.randn(8, 64, generator=g).bfloat16()
    assert_bitwise(mx_quantize(xb), torchao_mx(xb))
    bad = torch.randn(4, 64, generator=g)
    bad[0, 3], bad[2, 40] = float("inf"), float("nan")
    ours = mx_quantize(bad)
    assert_bitwise(ours, torchao_mx(bad))
    assert ours[2, 32:].isnan().all()  # a NaN takes its whole block (the e8m0 NaN scale)
    assert ours[0, 3] == float("inf") and (ours[0, :32].isinf().sum() == 1)  # inf stays; its block's
    assert (ours[0, :3] == 0).all()  # other elements fall 2**127 below it
    assert ours[1].isfinite().all() and ours[3].isfinite().all()


def test_mx_quantize_pads_a_partial_block_with_zeros():
    """A last dimension that is not a multiple of 32: the emulation pads (torchao asserts)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 40, generator=g)
    padded = torchao_mx(nn.functional.pad(x, (0, 24)))[:, :40]
    assert_bitwise(mx_quantize(x), padded)


def test_mx_quantize_elements_are_e4m3_times_a_power_of_two_per_block():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 64, generator=g) * torch.logspace(-5, 5, 16).unsqueeze(1)
    q = mx_quantize(x).reshape(16, 2, 32)
    amax = x.reshape(16, 2, 32).abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))  # RCEIL: the power of two at/above amax/448
    elements = q / scale
    assert elements.abs().max() <= 448.0
    assert torch.equal(elements, elements.to(torch.float8_e4m3fn).float())  # on the e4m3 grid


@pytest.mark.parametrize("x", [x for _, x in NV_SAMPLES], ids=[n for n, _ in NV_SAMPLES])
def test_nvfp4_quantize_round_to_nearest_is_torchao_bit_for_bit(x):
    if not bool(x.abs().amax() > 0):
        pytest.skip("all zeros: see test_nvfp4_all_zeros_are_zeros_where_torchao_gives_nan")
    assert_bitwise(nvfp4_quantize(x), torchao_nvfp4(x.contiguous()))


def test_nvfp4_quantize_is_torchao_on_3d_bf16_and_a_dynamic_range_past_e4m3():
    g = torch.Generator().manual_seed(8)
    x3 = torch.randn(3, 5, 64, generator=g)
    assert_bitwise(nvfp4_quantize(x3), torchao_nvfp4(x3))
    xb = torch.randn(8, 64, generator=g).bfloat16()
    assert_bitwise(nvfp4_quantize(xb), torchao_nvfp4(xb))
    wide = torch.randn(4, 64, generator=g)
    wide[0, 0] = 1e6  # the other blocks' scales fall below e4m3's floor: flushed as torchao flushes them
    ours = nvfp4_quantize(wide)
    assert_bitwise(ours, torchao_nvfp4(wide))
    assert (ours[1:] == 0).float().mean() > 0.5


def test_nvfp4_all_zeros_are_zeros_where_torchao_gives_nan():
    """torchao's per-tensor scale of an all-zero tensor is 0 and its reciprocal inf: NaN throughout.
    The emulation returns the zeros a GEMM on them should see."""
    zeros = torch.zeros(4, 32)
    assert torch.equal(nvfp4_quantize(zeros), zeros)
    assert torch.equal(nvfp4_quantize(zeros, tiles=True), zeros)
    assert torch.equal(nvfp4_quantize(zeros, generator=torch.Generator().manual_seed(0)), zeros)
    assert torchao_nvfp4(zeros).isnan().all()  # documents torchao's behaviour the emulation departs from


def test_nvfp4_nonfinite_input_propagates_nan():
    x = torch.randn(4, 32)
    x[1, 2] = float("inf")
    assert nvfp4_quantize(x).isnan().all()  # the tensor scale is inf: nothing finite survives


# ---------------------------------------------------------------------------- e2m1 rounding
@pytest.mark.parametrize(
    ("value", "rounded"),
    [
        (0.25, 0.0),  # ties to even: 0 (mantissa 0) over 0.5 (subnormal, mantissa 1)
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        (0.2, 0.0),
        (0.3, 0.5),
        (1.1, 1.0),
        (2.9, 3.0),
        (4.9, 4.0),
        (5.1, 6.0),
        (6.0, 6.0),
        (6.9, 6.0),  # saturates
        (100.0, 6.0),
    ],
)
def test_round_e2m1_rounds_to_nearest_even_on_the_grid(value, rounded):
    got = round_e2m1(torch.tensor([value, -value]))
    assert got.tolist() == [rounded, -rounded]


def test_round_e2m1_keeps_grid_points_and_the_sign_of_zero():
    grid = torch.cat([E2M1_GRID, -E2M1_GRID])
    assert torch.equal(round_e2m1(grid), grid)
    assert torch.signbit(round_e2m1(torch.tensor([-0.1]))).item()  # -0.1 -> -0.0, as a cast gives
    noise = torch.rand(1000, grid.numel(), generator=torch.Generator().manual_seed(0))
    assert torch.equal(round_e2m1(grid.expand(1000, -1), noise), grid.expand(1000, -1))


def _neighbours(v: float) -> tuple[float, float]:
    grid = E2M1_GRID.tolist()
    lo = max(g for g in grid if g <= abs(v))
    hi = min(g for g in grid if g >= abs(v))
    return (lo, hi) if v >= 0 else (-hi, -lo)


def test_round_e2m1_stochastic_gives_the_two_neighbours_unbiased():
    values = torch.tensor([0.1, 0.3, 0.74, 1.2, 1.9, 2.2, 2.5, 3.7, 4.5, 5.9, -0.6, -3.3, -5.0])
    n = 20000
    noise = torch.rand(n, values.numel(), generator=torch.Generator().manual_seed(42))
    draws = round_e2m1(values.expand(n, -1), noise)
    for j, v in enumerate(values.tolist()):
        lo, hi = _neighbours(v)
        column = draws[:, j]
        assert set(column.unique().tolist()) <= {lo, hi}, (v, column.unique())
        assert (column == lo).any() and (column == hi).any(), v  # both occur: not round-to-nearest
        p = (v - lo) / (hi - lo)
        stderr = (hi - lo) * (p * (1 - p) / n) ** 0.5
        assert abs(column.double().mean().item() - v) < 5 * stderr, (v, column.mean().item(), stderr)


def test_nvfp4_stochastic_rounding_is_unbiased_uses_its_generator_only_and_repeats_with_its_seed():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, generator=g)
    state = torch.get_rng_state()
    gen = torch.Generator().manual_seed(11)
    draws = torch.stack([nvfp4_quantize(x, generator=gen) for _ in range(2000)])
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    nearest = nvfp4_quantize(x)
    assert not torch.equal(draws[0], draws[1])  # fresh noise per call
    assert not torch.equal(draws[0], nearest)
    blocks = x.reshape(4, 2, 16).abs().amax(-1, keepdim=True).expand(4, 2, 16).reshape(4, 32)
    inner = x.abs() < 0.9 * blocks  # the block's amax may saturate at 6, deterministically
    spread = (draws.max(0).values - draws.min(0).values).clamp_min(1e-12)
    stderr = spread / 2 / 2000**0.5  # at most half the gap's spread per draw
    err = (draws.double().mean(0) - x.double()).abs()
    assert (err[inner] < 5 * stderr[inner] + 1e-7).all(), err[inner].max()
    again = torch.Generator().manual_seed(11)
    assert torch.equal(nvfp4_quantize(x, generator=again), draws[0])


# ---------------------------------------------------------------------------- NVFP4 16x16 tiles
def _tile_scales(q: torch.Tensor) -> list[float]:
    """Each 16x16 tile's dequantised values over one shared scale: every value on the e2m1 grid
    times the tile's amax / 6 (a non-flushed tile's amax rounds to 6, e4m3 rounding being < 7%)."""
    scales = []
    rows, cols = q.shape
    for r in range(0, rows, 16):
        for c in range(0, cols, 16):
            tile = q[r : r + 16, c : c + 16]
            s = tile.abs().amax() / 6.0
            units = tile.abs() / s
            nearest = E2M1_GRID[(units.unsqueeze(-1) - E2M1_GRID).abs().argmin(-1)]
            assert torch.allclose(units, nearest, rtol=1e-6, atol=1e-6), (r, c, units.unique())
            scales.append(float(s))
    return scales


def test_nvfp4_tiles_share_one_scale_per_16x16_tile():
    g = torch.Generator().manual_seed(9)
    cols = torch.tensor([0.1, 1.0, 10.0]).repeat_interleave(16)
    rows_mag = torch.tensor([1.0, 3.0]).repeat_interleave(16)
    w = torch.randn(32, 48, generator=g) * rows_mag[:, None] * cols[None, :]
    w[3, 5] = 20.0  # one large value: its whole tile (rows 0-15, cols 0-15) takes its scale
    tiled = nvfp4_quantize(w, tiles=True)
    scales = _tile_scales(tiled)
    assert len(set(scales)) > 3  # tiles have scales of their own, not one for the tensor
    rows = nvfp4_quantize(w)
    with pytest.raises(AssertionError):  # the check tells tiles from 1-D blocks, which scale per row
        _tile_scales(rows)
    assert not torch.equal(tiled[:16, :16], rows[:16, :16])  # 1-D blocks: each row its own scale
    # the rows of the large value's tile lose what 1-D blocks keep: coarser than their own scale
    err_tiled = (tiled[:16, :16] - w[:16, :16]).abs().sum()
    err_rows = (rows[:16, :16] - w[:16, :16]).abs().sum()
    assert err_tiled > err_rows


@pytest.mark.parametrize("shape", [(16, 16), (32, 48), (64, 64), (16, 128), (40, 24)])
def test_nvfp4_tiled_weight_and_its_transpose_quantise_alike(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(10))
    assert torch.equal(nvfp4_quantize(w, tiles=True).t(), nvfp4_quantize(w.t().contiguous(), tiles=True))
    if shape[0] != shape[1]:  # without tiles the two layouts block differently
        assert not torch.equal(nvfp4_quantize(w).t(), nvfp4_quantize(w.t().contiguous()))


def test_nvfp4_tiles_need_a_2d_tensor():
    with pytest.raises(ValueError, match="2-D"):
        nvfp4_quantize(torch.randn(2, 16, 16), tiles=True)


# ---------------------------------------------------------------------------- Hadamard
def _signs(seed: int) -> torch.Tensor:
    return (torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(seed)) * 2 - 1).float()


def test_hadamard_rows_is_orthogonal_and_cancels_over_the_reduction():
    g = torch.Generator().manual_seed(12)
    signs = _signs(1)
    assert (signs == 1).any() and (signs == -1).any()
    a, b = torch.randn(64, 24, generator=g), torch.randn(64, 40, generator=g)
    ha, hb = hadamard_rows(a, signs), hadamard_rows(b, signs)
    torch.testing.assert_close(ha.t() @ hb, a.t() @ b, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(ha, a)  # it does transform
    torch.testing.assert_close(ha.norm(dim=0), a.norm(dim=0), rtol=1e-5, atol=0)
    # its matrix: Q^T of one 16-row block, orthogonal; Q (Q^T x) is x again
    qt = hadamard_rows(torch.eye(16), signs)
    torch.testing.assert_close(qt @ qt.t(), torch.eye(16), rtol=0, atol=1e-6)
    back = (qt.t() @ ha.reshape(4, 16, 24)).reshape(64, 24)
    torch.testing.assert_close(back, a, rtol=1e-5, atol=1e-5)


def test_hadamard_rows_runs_on_the_device_of_its_operands():
    """The signs live on the input's device (a CUDA layer draws them on CUDA); the transform was
    built on the CPU, and nvfp4's wgrad crashed on the first GPU run (H200). The meta device stands
    in for CUDA here: it raises the same device mismatch."""
    x, signs = torch.empty(32, 8, device="meta"), torch.empty(16, device="meta")
    assert hadamard_rows(x, signs).device.type == "meta"


def test_hadamard_rows_mixes_within_16_row_blocks_and_spreads_an_outlier():
    x = torch.zeros(32, 3)
    x[20, 1] = 1e6
    y = hadamard_rows(x, _signs(2))
    assert torch.equal(y[:16], torch.zeros(16, 3))  # the first block never sees row 20
    assert torch.equal(y[16:, 1].abs(), torch.full((16,), 1e6 / 4))  # spread over its 16 rows
    # with all-positive signs it is its own inverse (Sylvester's H is symmetric, (H/4)^2 = I)
    ones = torch.ones(16)
    z = torch.randn(48, 5, generator=torch.Generator().manual_seed(13))
    torch.testing.assert_close(hadamard_rows(hadamard_rows(z, ones), ones), z, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- BlockLinear
def _grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(output, grad_input, grad_weight, grad_bias) of one forward and backward with ``dy``."""
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(dy)
    bias = module.bias.grad.clone() if module.bias is not None else torch.zeros(0)
    return out.detach(), x.grad, module.weight.grad.clone(), bias


def _mxfp8_linear(linear: nn.Linear, wgrad_with_hp: bool = False) -> MXFP8Linear:
    ao = MXFP8Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        kernel_preference=KernelPreference.EMULATED,
        scale_calculation_mode=ScaleCalculationMode.RCEIL,
        wgrad_with_hp=wgrad_with_hp,
    )
    ao.weight, ao.bias = linear.weight, linear.bias
    return ao


@pytest.mark.parametrize(
    ("lead", "k", "n", "bias"),
    [((4, 8), 64, 96, True), ((64,), 128, 32, True), ((2, 16), 256, 128, False), ((96,), 32, 64, True)],
)
def test_block_linear_mxfp8_is_torchao_mxfp8_linear_bit_for_bit(lead, k, n, bias):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=bias)
    x, dy = torch.randn(*lead, k), torch.randn(*lead, n)
    ours = _grads(BlockLinear(linear, MXFP8, ALL), x, dy)
    theirs = _grads(_mxfp8_linear(linear), x, dy)
    for what, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), ours, theirs, strict=True):
        assert torch.equal(a, b), what


def test_block_linear_pads_tokens_torchao_cannot_take():
    """21 tokens: torchao's wgrad blocks over the tokens and asserts a multiple of 32; the emulation
    pads with zero tokens, which is torchao's result on the zero-padded batch."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 64)
    x, dy = torch.randn(3, 7, 64), torch.randn(3, 7, 64)
    with pytest.raises(AssertionError, match="divisible by block_size"):
        _grads(_mxfp8_linear(linear), x, dy)
    out, gx, gw, _ = _grads(BlockLinear(linear, MXFP8, ALL), x, dy)
    pad = torch.zeros(11, 64)
    p_out, p_gx, p_gw, _ = _grads(
        _mxfp8_linear(linear), torch.cat([x.reshape(21, 64), pad]), torch.cat([dy.reshape(21, 64), pad])
    )
    assert torch.equal(out.reshape(21, 64), p_out[:21])
    assert torch.equal(gx.reshape(21, 64), p_gx[:21])
    assert torch.equal(gw, p_gw)


def test_torchao_block_linear_shares_parameters_and_matches_the_emulation():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    x, dy = torch.randn(32, 64), torch.randn(32, 96)
    ao = torchao_block_linear(linear, MXFP8, ALL, "EMULATED")
    assert isinstance(ao, MXFP8Linear)
    assert ao.weight is linear.weight and ao.bias is linear.bias
    assert ao.kernel_preference == KernelPreference.EMULATED
    assert ao.scale_calculation_mode == ScaleCalculationMode.RCEIL and not ao.wgrad_with_hp
    ours = _grads(BlockLinear(linear, MXFP8, ALL), x, dy)
    theirs = _grads(ao, x, dy)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)

    no_wgrad = torchao_block_linear(linear, MXFP8, frozenset({"forward", "dgrad"}), "EMULATED")
    assert isinstance(no_wgrad, MXFP8Linear) and no_wgrad.wgrad_with_hp
    assert no_wgrad.weight is linear.weight
    kept = _grads(no_wgrad, x, dy)
    emulated = _grads(BlockLinear(linear, MXFP8, frozenset({"forward", "dgrad"})), x, dy)
    assert torch.equal(kept[0], emulated[0]) and torch.equal(kept[1], emulated[1])
    assert not torch.equal(kept[2], ours[2])  # the weight gradient left MXFP8
    # what torchao cannot express falls back to the emulation (None)
    assert torchao_block_linear(linear, MXFP8, frozenset({"forward"}), "EMULATED") is None
    assert torchao_block_linear(linear, MXFP8, frozenset({"dgrad", "wgrad"}), "EMULATED") is None
    assert torchao_block_linear(linear, NVFP4, ALL, "EMULATED") is None
    assert torchao_block_linear(linear, NVFP4, frozenset({"forward"}), "AUTO") is None


@pytest.mark.parametrize("fmt", [MXFP8, NVFP4], ids=lambda f: f.name)
def test_each_direction_changes_only_its_own_gemm(fmt):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x, dy = torch.randn(48, 64), torch.randn(48, 32)
    high = _grads(BlockLinear(linear, fmt, frozenset()), x, dy)
    xb, wb, dyb = x.bfloat16().float(), linear.weight.detach().bfloat16().float(), dy.bfloat16().float()
    # no direction in the format: each GEMM has bf16 operands, fp32 accumulation
    assert torch.equal(high[0], xb @ wb.t() + linear.bias.detach())
    assert torch.equal(high[1], dyb @ wb)
    assert torch.equal(high[2], dyb.t() @ xb)
    low = _grads(BlockLinear(linear, fmt, ALL, seed=1), x, dy)
    for index, direction in enumerate(DIRECTIONS):
        one = _grads(BlockLinear(linear, fmt, frozenset({direction}), seed=1), x, dy)
        for j in range(3):
            if j == index:
                assert not torch.equal(one[j], high[j]), (direction, j)
                if fmt is MXFP8 or direction == "forward":  # NVFP4's gradients draw noise in order
                    assert torch.equal(one[j], low[j]), (direction, j)
            else:
                assert torch.equal(one[j], high[j]), (direction, j)
        assert torch.equal(one[3], high[3])  # the bias gradient is dy summed: no GEMM


def test_forward_only_leaves_the_weight_gradient_in_bf16():
    torch.manual_seed(0)
    linear = nn.Linear(32, 64)
    x, dy = torch.randn(40, 32), torch.randn(40, 64)
    out, gx, gw, _ = _grads(BlockLinear(linear, MXFP8, frozenset({"forward"})), x, dy)
    xb, dyb, wb = x.bfloat16().float(), dy.bfloat16().float(), linear.weight.detach().bfloat16().float()
    assert torch.equal(gw, dyb.t() @ xb)
    assert torch.equal(gx, dyb @ wb)
    assert not torch.equal(out, xb @ wb.t() + linear.bias.detach())  # the forward is MXFP8
    expected = mx_quantize(x) @ mx_quantize(linear.weight.detach()).t() + linear.bias.detach()
    assert torch.equal(out, expected)


def test_a_frozen_weight_or_input_skips_its_gemm():
    torch.manual_seed(0)
    linear = nn.Linear(32, 32).requires_grad_(False)
    layer = BlockLinear(linear, NVFP4, ALL)
    x = torch.randn(16, 32, requires_grad=True)
    layer(x).sum().backward()
    assert linear.weight.grad is None and x.grad is not None


def test_block_linear_output_dtype_follows_autocast():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    for fmt in (MXFP8, NVFP4):
        layer = BlockLinear(linear, fmt, ALL)
        x = torch.randn(16, 64)
        assert layer(x).dtype == torch.float32
        with torch.autocast("cpu", torch.bfloat16):
            h = nn.functional.linear(x, torch.eye(64))  # a bf16 activation, as autocast leaves it
            out = layer(h)
        assert h.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
        out.float().sum().backward()
        assert linear.weight.grad is not None and linear.weight.grad.dtype == torch.float32
        linear.zero_grad(set_to_none=True)
        assert not torch.is_autocast_enabled("cpu")


def test_nvfp4_randomness_is_the_layers_own_and_repeats_with_its_seed():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x, dy = torch.randn(32, 64), torch.randn(32, 32)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = _grads(BlockLinear(linear, NVFP4, ALL, seed=7), x, dy)
    assert torch.equal(torch.get_rng_state(), state)  # the fp32 reference's RNG is not consumed
    second = _grads(BlockLinear(linear, NVFP4, ALL, seed=7), x, dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    other = _grads(BlockLinear(linear, NVFP4, ALL, seed=8), x, dy)
    assert torch.equal(other[0], first[0])  # the forward rounds to nearest: no noise
    assert not torch.equal(other[1], first[1]) and not torch.equal(other[2], first[2])
    # one layer draws fresh noise each step: the gradients of a repeated step differ
    layer = BlockLinear(linear, NVFP4, ALL, seed=7)
    step1, step2 = _grads(layer, x, dy), _grads(layer, x, dy)
    assert torch.equal(step1[0], step2[0]) and not torch.equal(step1[2], step2[2])


def test_an_empty_batch_quantises_to_an_empty_tensor_in_every_format():
    """An MoE expert that receives no tokens: NVFP4's tensor amax raised on an empty tensor."""
    lin = nn.Linear(32, 32)
    for fmt in (bs.MXFP8, bs.NVFP4):
        layer = bs.BlockLinear(lin, fmt, frozenset(bs.DIRECTIONS), seed=1)
        x = torch.randn(0, 32, requires_grad=True)
        out = layer(x)
        out.sum().backward()
        assert out.shape == (0, 32) and x.grad.shape == (0, 32)


def test_layer_seeds_tell_anagram_names_apart():
    assert bs.seed_of("layers.12.mlp.fc1") != bs.seed_of("layers.21.mlp.fc1")
    names = [f"layers.{i}.{p}" for i in range(64) for p in ("q", "k", "v", "o", "up", "down", "gate")]
    assert len({bs.seed_of(n) for n in names}) == len(names)


def test_torchaos_padded_mxfp8_linear_takes_any_token_count_and_matches_the_emulation():
    """torchao's MXFP8Linear asserts when the tokens are not a multiple of 32; the path Policy.prepare
    takes on Blackwell pads them (zero rows change no block) and matches the emulation bit for bit."""
    from mixprec.policy.lowformat import torchao_block_linear

    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    ours = bs.BlockLinear(lin, bs.MXFP8, frozenset(bs.DIRECTIONS))
    theirs = torchao_block_linear(lin, bs.MXFP8, frozenset(bs.DIRECTIONS), "EMULATED")
    assert theirs.weight is lin.weight and theirs.bias is lin.bias
    x = torch.randn(3, 7, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y_theirs, y_ours = theirs(x), ours(x2)
    assert torch.equal(y_theirs, y_ours)
    g = torch.randn_like(y_ours)
    a = torch.autograd.grad(y_theirs, [x, lin.weight, lin.bias], g)
    b = torch.autograd.grad(y_ours, [x2, lin.weight, lin.bias], g)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    restored = pickle.loads(pickle.dumps(nn.Sequential(theirs)))  # torch.save of a whole model
    assert type(restored[0]).__name__ == type(theirs).__name__
