"""Per-layer forward/backward ranges on a real training step (mixprec.numerics.ranges)."""

from __future__ import annotations

import copy
import json
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.frameworks.torch.ranges import collect_ranges
from mixprec.numerics.limits import FORMATS
from mixprec.numerics.ranges import RangeReport, TensorRange

FP16_MAX = FORMATS["fp16"].max_finite


def _hooks_left(model: nn.Module) -> list[str]:
    attrs = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
    )
    modules = model.named_modules()
    return [f"{name or '<root>'}.{a}" for name, m in modules for a in attrs if getattr(m, a, None)]


def _planted() -> nn.Sequential:
    """``big`` multiplies its input by 1e5: past fp16's 65504, far inside bf16's range."""
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            fc=nn.Linear(8, 16),
            big=nn.Linear(16, 16),
            relu=nn.ReLU(),
            head=nn.Linear(16, 1),
        )
    )
    with torch.no_grad():
        model.big.weight.copy_(torch.eye(16) * 1e5)
        model.big.bias.zero_()
    return model


def _mlp() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _mse_step(model: nn.Module, x: torch.Tensor, scale: float = 1.0):
    return lambda: model(x).float().pow(2).mean() * scale


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class NaNInBackward(nn.Module):
    def forward(self, x):
        return _NaNGrad.apply(x)


def test_planted_overflow_fp32_ranges():
    model = _planted()
    x = torch.randn(4, 8)
    report = collect_ranges(model, _mse_step(model, x))
    big = report.layer("big").forward
    assert big.overflow_fraction("fp16") > 0
    assert big.headroom_bits("fp16") < 0
    assert big.headroom_bits("bf16") > 0
    assert big.overflow_fraction("bf16") == 0
    assert report.layer("fc").forward.headroom_bits("fp16") > 0
    assert big.absmax == pytest.approx(model.big(model.fc(x)).abs().max().item())
    assert report.first_nonfinite_forward is None  # fp32 holds it
    worst = report.worst(5, "fp16")
    assert worst[0].min_headroom("fp16") < 0  # fc's gradient: big's 1e5 flows back through it too
    assert "big" in {lr.name for lr in worst}
    assert [lr.name for lr in report.layers] == ["", "fc", "big", "relu", "head"]


def test_autocast_fp16_names_the_producer_not_its_successors():
    model = _planted()
    x = torch.randn(4, 8)

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        return out.float().pow(2).mean()

    report = collect_ranges(model, step)
    assert report.first_nonfinite_forward == "big"
    big = report.layer("big").forward
    assert big.nonfinite > 0 and "float16" in big.dtypes
    assert big.headroom_bits("fp16") == -math.inf
    assert report.layer("relu").forward.nonfinite > 0  # passed on, but not blamed
    assert report.layer("fc").forward.nonfinite == 0


def test_nan_only_in_backward_names_that_module():
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(fc1=nn.Linear(8, 8), bad=NaNInBackward(), act=nn.ReLU(inplace=True), fc2=nn.Linear(8, 2))
    )
    report = collect_ranges(model, _mse_step(model, torch.randn(4, 8)))
    assert report.first_nonfinite_forward is None
    assert report.first_nonfinite_backward == "bad"
    assert report.layer("fc1").backward.nonfinite > 0
    assert report.layer("bad").backward.nonfinite == 0


class _Branchy(nn.Module):
    """A healthy and a NaN-backward branch share one input: the shared gradient must not blame ``good``."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.good = nn.Linear(8, 8)
        self.bad = NaNInBackward()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.stem(x)
        return self.head(self.good(h) + self.bad(h))


def test_nan_backward_with_shared_input_blames_the_right_branch():
    torch.manual_seed(0)
    model = _Branchy()
    report = collect_ranges(model, _mse_step(model, torch.randn(4, 8)))
    assert report.first_nonfinite_backward == "bad"
    assert report.first_nonfinite_forward is None


def test_tiny_loss_underflows_fp16_grads_without_scaling():
    model = _mlp()
    x = torch.randn(16, 8)
    report = collect_ranges(model, _mse_step(model, x, 1e-10))
    g = report.grad_underflow_fp16
    assert g["scale"] == 2.0**16
    assert g["unscaled"] > 0.5
    assert g["scaled"] < 0.2 * g["unscaled"]

    # with an explicit scale: backward ranges are the scaled ones, .grad ends up unscaled, same figures
    plain = copy.deepcopy(model)
    plain(x).pow(2).mean().mul(1e-10).backward()
    scaled = collect_ranges(model, _mse_step(model, x, 1e-10), loss_scale=2.0**16)
    assert scaled.grad_underflow_fp16["unscaled"] == pytest.approx(g["unscaled"])
    assert scaled.grad_underflow_fp16["scaled"] == pytest.approx(g["scaled"])
    assert scaled.layer("3").backward.absmax == report.layer("3").backward.absmax * 2.0**16
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_healthy_mlp_has_headroom_everywhere():
    model = _mlp()
    report = collect_ranges(model, _mse_step(model, torch.randn(16, 8)))
    assert report.first_nonfinite_forward is None and report.first_nonfinite_backward is None
    for lr in report.layers:
        for tr in (lr.forward, lr.backward):
            assert tr.count > 0 and tr.nonfinite == 0
            assert tr.overflow_fraction("fp16") == 0
            assert tr.headroom_bits("fp16") > 0
    worst = report.worst(3)
    assert len(worst) == 3
    hs = [lr.min_headroom("fp16") for lr in worst]
    assert hs == sorted(hs)
    json.dumps(report.to_dict())  # plain JSON when everything is finite


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(self.lin(x))


def test_reused_module_aggregates_streaming():
    torch.manual_seed(0)
    model = _Twice()
    x = torch.randn(5, 6)
    report = collect_ranges(model, _mse_step(model, x))
    lin = report.layer("lin")
    assert lin.calls == 2
    assert lin.forward.count == 2 * 30
    assert lin.backward.count == 2 * 30
    with torch.no_grad():
        a = model.lin(x)
        b = model.lin(a)
    assert lin.forward.absmax == max(a.abs().max().item(), b.abs().max().item())
    assert lin.forward.min_nonzero == min(a.abs().min().item(), b.abs().min().item())

    one, two, both = TensorRange(), TensorRange(), TensorRange()
    one.update(a)
    two.update(b)
    both.update(a)
    both.update(b)
    assert one.merge(two) == both


def test_tensor_range_counts_and_thresholds():
    sub = FORMATS["fp16"].smallest_subnormal
    t = torch.tensor([0.0, 1e5, -7e4, 1.0, sub / 4, 1e-6, float("inf"), float("nan")], dtype=torch.float32)
    r = TensorRange()
    assert r.update(t) is True
    assert (r.count, r.nonfinite, r.zeros, r.nonzero) == (8, 2, 1, 5)
    assert r.absmax == math.inf and r.min_nonzero == pytest.approx(sub / 4)
    assert r.overflow_fraction("fp16") == 3 / 8  # 1e5, -7e4, inf
    assert r.underflow_fraction("fp16") == 1 / 5  # sub/4 rounds to zero
    assert r.subnormal_fraction("fp16") == 2 / 5  # and 1e-6 is subnormal
    assert r.overflow_fraction("bf16") == 1 / 8  # only the inf
    fin = TensorRange()
    fin.update(torch.tensor([2.0**-3, -(2.0**10)], dtype=torch.bfloat16))
    assert fin.headroom_bits("fp16") == pytest.approx(math.log2(FP16_MAX / 2**10))
    assert TensorRange().headroom_bits("fp16") is None


class _Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def test_hooks_removed_and_state_restored_even_on_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), _Boom())
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="boom"):
        collect_ranges(model, _mse_step(model, torch.randn(3, 4)))
    assert _hooks_left(model) == []
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))

    healthy = _mlp()
    collect_ranges(healthy, _mse_step(healthy, torch.randn(2, 8)))
    assert _hooks_left(healthy) == []


class _SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)  # breaks register_full_backward_hook; must work here
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        h = self.drop(self.relu(self.bn(self.conv(x))))
        return self.fc(h.mean(dim=(2, 3)))


def test_bitwise_equal_outputs_and_grads_and_buffers_untouched():
    torch.manual_seed(0)
    model = _SmallCNN()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "batches" in k}

    torch.manual_seed(5)
    ref_out = reference(x)
    ref_out.pow(2).mean().backward()

    seen = {}

    def step():
        torch.manual_seed(5)
        seen["out"] = model(x)
        return seen["out"].pow(2).mean()

    report = collect_ranges(model, step)
    assert torch.equal(seen["out"], ref_out)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    for k, v in buffers.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert {"conv", "bn", "relu", "drop", "fc"} <= {lr.name for lr in report.layers}
    assert report.layer("bn").backward.count == 4 * 8 * 8 * 8
    assert report.first_nonfinite_forward is None and report.first_nonfinite_backward is None
    assert _hooks_left(model) == []


class _Block(nn.Module):
    """GPT-like: LayerNorm, nn.MultiheadAttention, and a second attention written with SDPA."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln2(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


def test_gpt_like_block():
    torch.manual_seed(0)
    model = _Block()
    report = collect_ranges(model, _mse_step(model, torch.randn(2, 5, 16)))
    names = {lr.name for lr in report.layers}
    assert {"", "ln1", "attn", "qkv", "proj", "mlp", "mlp.0", "mlp.2"} <= names
    for name in ("attn", "qkv", "proj", "mlp.0"):
        lr = report.layer(name)
        assert lr.forward.count > 0 and lr.backward.count > 0
        assert lr.forward.headroom_bits("fp16") > 0
    assert report.first_nonfinite_forward is None and report.first_nonfinite_backward is None
    assert _hooks_left(model) == []


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        ya, yb = self.a(x), self.b(x)
        return {"logits": ya, "aux": (yb, [yb.detach() * 2, torch.arange(3)]), "note": "text"}


def test_dict_and_tuple_outputs():
    torch.manual_seed(0)
    model = _DictOut()
    x = torch.randn(5, 4)

    def step():
        out = model(x)
        return out["logits"].pow(2).mean() + out["aux"][0].sum()

    report = collect_ranges(model, step)
    root = report.layer("")
    assert root.forward.count == 15 + 10 + 10  # integer tensors and strings are skipped
    assert root.backward.count == 15 + 10  # the detached copy gets no gradient
    assert report.layer("b").backward.count == 10
    assert report.layers[0].name == "" and report.layers[0].order == 0
    assert isinstance(report, RangeReport)


def _brute_force(x: torch.Tensor) -> dict[str, float]:
    """Every count of TensorRange by its definition, one comparison per count (the slow way)."""
    from mixprec.numerics.limits import FORMATS, LOW_PRECISION_FORMATS

    a = (x.double() if x.dtype == torch.float64 else x.float()).abs()
    finite = torch.isfinite(a)
    nz = finite & (a != 0)
    out = {"nonfinite": float((~finite).sum()), "zeros": float((a == 0).sum()), "nonzero": float(nz.sum())}
    for fmt in LOW_PRECISION_FORMATS:
        lim = FORMATS[fmt]
        out[f"over {fmt}"] = float((a > lim.max_finite).sum())
        out[f"under {fmt}"] = float((nz & (a <= lim.smallest_subnormal / 2)).sum())
        out[f"sub {fmt}"] = float((nz & (a < lim.smallest_normal)).sum())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_one_pass_counts_equal_the_counts_by_definition(dtype):
    """The single-pass histogram counts exactly what one comparison per count would, at every
    threshold's edge, for inf, NaN, zeros, subnormals and values just beyond bf16's range."""
    from mixprec.numerics.limits import FORMATS, LOW_PRECISION_FORMATS

    edges = [0.0, -0.0, math.inf, -math.inf, math.nan, 3.39e38, 3.4e38]
    for fmt in LOW_PRECISION_FORMATS:
        lim = FORMATS[fmt]
        for v in (lim.max_finite, lim.smallest_normal, lim.smallest_subnormal / 2, lim.smallest_subnormal):
            edges += [v, math.nextafter(v, 0), math.nextafter(v, math.inf), -v]
    gen = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.tensor(edges, dtype=torch.float64),
            torch.randn(4000, generator=gen, dtype=torch.float64)
            * 10.0 ** torch.randint(-45, 40, (4000,), generator=gen),
        ]
    ).to(dtype)
    r = TensorRange()
    r.update(x)
    want = _brute_force(x)
    got = {"nonfinite": r.nonfinite, "zeros": r.zeros, "nonzero": r.nonzero}
    for fmt in LOW_PRECISION_FORMATS:
        got[f"over {fmt}"] = r.overflow_count[fmt]
        got[f"under {fmt}"] = r.underflow_count[fmt]
        got[f"sub {fmt}"] = r.subnormal_count[fmt]
    assert got == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fmt", [None, "fp16", "bf16"])
def test_the_light_update_agrees_with_the_full_one(dtype, fmt):
    """The per-step update (aminmax first, non-finite counts only when needed, no flush search in a
    tensor that cannot hold a flushing value) gives the full update's figures on what it records."""
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(257, generator=g) * 10.0 ** torch.randint(-40, 6, (257,), generator=g).float(),
        torch.tensor([0.0, -0.0, 1e-30, 3e-8, -7.0, 2.0]),
        torch.tensor([float("nan"), 1.0, float("-inf"), 0.0, 1e-9]),
        torch.tensor([float("inf"), -4.0]),
        torch.tensor(2.5),
        torch.zeros(0),
    ]
    for x in cases:
        x = x.to(dtype)
        light, full = TensorRange(), TensorRange()
        assert light.update_light(x, fmt) == full.update(x)
        assert (light.absmax, light.nonfinite, light.count) == (full.absmax, full.nonfinite, full.count)
        if fmt is not None:
            assert (light.zeros, light.nonzero) == (full.zeros, full.nonzero)
            assert light.underflow_fraction(fmt) == full.underflow_fraction(fmt)
