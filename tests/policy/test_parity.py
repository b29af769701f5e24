"""Differential tests: a loop through mixprec vs the same loop written with GradScaler by the book.

Both loops start from a deep copy of one model, see the same pre-generated batches and get the
same faults injected at the same steps. Weights, optimizer-visible effects and the loss scale
must come out bitwise equal; mixprec's skip accounting must match what GradScaler did.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

STEPS = 8
BATCH = 16
INF = float("inf")
NAN = float("nan")


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here trains tiny models: one thread (see conftest.single_thread)."""


# ---------------------------------------------------------------------------------------- helpers
def make_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


def make_batches(steps: int = STEPS, micro: int = 1, seed: int = 1) -> list[list[tuple]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(micro)
        ]
        for _ in range(steps)
    ]


@dataclass(frozen=True)
class LossFault:
    """Multiply the loss of micro-batch ``micro`` at ``step`` by ``factor`` (inf, -inf or NaN)."""

    step: int
    factor: float
    micro: int = 0


@dataclass(frozen=True)
class GradFault:
    """Write ``value`` into ``param``'s gradient at ``step``, after backward and before the step."""

    step: int
    param: str
    value: float


@dataclass
class RunResult:
    model: nn.Module
    snapshots: list[dict[str, torch.Tensor]] = field(default_factory=list)  # params after each step
    scales: list[float] = field(default_factory=list)  # scale after each step's update
    returned: list[bool] = field(default_factory=list)  # mixprec only: policy.step(...) results
    policy: mixprec.Policy | None = None
    scaler: torch.amp.GradScaler | None = None

    @property
    def scale_decreases(self) -> int:
        return sum(1 for a, b in itertools.pairwise(self.scales) if b < a)


OptFactory = Callable[[nn.Module], list[torch.optim.Optimizer]]


def single(cls: type, **kw) -> OptFactory:
    return lambda model: [cls(model.parameters(), **kw)]


def split_last_layer(cls: type, **kw) -> OptFactory:
    """Two optimizers over one model: everything but the last Linear, and the last Linear."""

    def make(model: nn.Module) -> list[torch.optim.Optimizer]:
        params = list(model.parameters())
        return [cls(params[:-2], **kw), cls(params[-2:], **kw)]

    return make


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _inject_grads(model: nn.Module, faults, step: int) -> None:
    params = dict(model.named_parameters())
    for f in faults:
        if isinstance(f, GradFault) and f.step == step:
            with torch.no_grad():
                params[f.param].grad.view(-1)[0] = f.value


def _loss_factor(faults, step: int, micro: int) -> float | None:
    for f in faults:
        if isinstance(f, LossFault) and f.step == step and f.micro == micro:
            return f.factor
    return None


def _micro_loss(model: nn.Module, x, y, n_micro: int, autocast_ctx, faults, step: int, m: int):
    with autocast_ctx():
        loss = F.cross_entropy(model(x), y)
    if n_micro > 1:
        loss = loss / n_micro
    factor = _loss_factor(faults, step, m)
    if factor is not None:
        loss = loss * factor
    return loss


def run_plain(
    model, make_opts: OptFactory, batches, faults=(), clip=None, device="cpu", **scaler_kw
) -> RunResult:
    """The loop as the PyTorch AMP recipe writes it."""
    device_type = torch.device(device).type
    model.to(device)
    opts = make_opts(model)
    scaler = torch.amp.GradScaler(device_type, **scaler_kw)
    res = RunResult(model=model, scaler=scaler, scales=[scaler.get_scale()])
    for step, micro in enumerate(batches):
        for m, (x, y) in enumerate(micro):
            x, y = x.to(device), y.to(device)
            loss = _micro_loss(
                model,
                x,
                y,
                len(micro),
                lambda: torch.autocast(device_type, dtype=torch.float16),
                faults,
                step,
                m,
            )
            scaler.scale(loss).backward()
        _inject_grads(model, faults, step)
        if clip is not None:
            for o in opts:
                scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for o in opts:
            scaler.step(o)
        scaler.update()
        for o in opts:
            o.zero_grad(set_to_none=True)
        res.snapshots.append(_snapshot(model))
        res.scales.append(scaler.get_scale())
    return res


def run_mixprec(
    model, make_opts: OptFactory, batches, faults=(), clip=None, device="cpu", **scaler_kw
) -> RunResult:
    policy = mixprec.get_policy("fp16-mixed", device=device, **scaler_kw)
    policy.prepare(model)
    opts = make_opts(model)
    res = RunResult(model=model, policy=policy, scales=[policy.scaler.get_scale()])
    with policy.precision_scope():
        for step, micro in enumerate(batches):
            for m, (x, y) in enumerate(micro):
                x, y = x.to(device), y.to(device)
                loss = _micro_loss(model, x, y, len(micro), policy.autocast, faults, step, m)
                policy.backward(loss)
            _inject_grads(model, faults, step)
            res.returned.append(policy.step(opts if len(opts) > 1 else opts[0], clip_grad_norm=clip))
            for o in opts:
                o.zero_grad(set_to_none=True)
            res.snapshots.append(_snapshot(model))
            res.scales.append(policy.scaler.get_scale())
    return res


def run_both(make_opts: OptFactory, faults=(), clip=None, micro: int = 1, device="cpu", **scaler_kw):
    base = make_mlp()
    batches = make_batches(micro=micro)
    plain = run_plain(copy.deepcopy(base), make_opts, batches, faults, clip, device, **scaler_kw)
    mixed = run_mixprec(copy.deepcopy(base), make_opts, batches, faults, clip, device, **scaler_kw)
    return base.to(device), plain, mixed


def assert_bitwise_equal(plain: RunResult, mixed: RunResult) -> None:
    for step, (a, b) in enumerate(zip(plain.snapshots, mixed.snapshots, strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"parameter {name} differs after step {step}"
    assert plain.scales == mixed.scales
    assert plain.scaler.get_scale() == mixed.policy.scaler.get_scale()


def assert_skip_accounting(plain: RunResult, mixed: RunResult, expected_skips: set[int]) -> None:
    stats = mixed.policy.stats
    assert stats.steps == STEPS
    assert stats.skipped_steps == plain.scale_decreases == len(expected_skips)
    assert [i for i, ok in enumerate(mixed.returned) if not ok] == sorted(expected_skips)
    if expected_skips:
        assert stats.last_skipped_step == max(expected_skips)
    else:
        assert stats.last_skipped_step is None
    assert stats.scale == mixed.scales[-1]
    assert [s for _, s in stats.scale_history] == mixed.scales[1:]


def _skip_steps(faults) -> set[int]:
    return {f.step for f in faults}


# ---------------------------------------------------------------------------------------- matrix
OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
}

FAULTS = {
    "none": (),
    "loss+inf@2": (LossFault(2, INF),),
    "loss-inf@3": (LossFault(3, -INF),),
    "loss-nan@5": (LossFault(5, NAN),),
    "grad-inf@3": (GradFault(3, "2.weight", INF),),
    "grad-nan@6": (GradFault(6, "4.bias", NAN),),
    "consecutive@1,2": (LossFault(1, INF), GradFault(2, "0.weight", -INF)),
}

SCALERS = {
    "default": {},
    # Small interval so the scale also grows within 8 steps.
    "growing": {"init_scale": 2.0**10, "growth_interval": 2},
}


@pytest.mark.parametrize("scaler_name", list(SCALERS))
@pytest.mark.parametrize("clip", [None, 0.25], ids=["noclip", "clip"])  # grad norms here are ~0.4
@pytest.mark.parametrize("fault_name", list(FAULTS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_parity_single_optimizer(opt_name, fault_name, clip, scaler_name):
    cls, kw = OPTIMIZERS[opt_name]
    faults = FAULTS[fault_name]
    base, plain, mixed = run_both(single(cls, **kw), faults, clip, **SCALERS[scaler_name])
    assert_bitwise_equal(plain, mixed)
    assert_skip_accounting(plain, mixed, _skip_steps(faults))
    # The run trained: the weights moved and stayed finite.
    final = mixed.snapshots[-1]
    assert any(not torch.equal(final[n], p) for n, p in base.named_parameters())
    assert all(torch.isfinite(t).all() for t in final.values())


@pytest.mark.parametrize("clip", [None, 0.2], ids=["noclip", "clip"])  # grad norms here are ~0.4
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_parity_gradient_accumulation(opt_name, clip):
    """Two micro-batches backward, then one step; a fault in the second micro-batch of step 4."""
    cls, kw = OPTIMIZERS[opt_name]
    faults = (LossFault(4, INF, micro=1), GradFault(6, "2.bias", NAN))
    _, plain, mixed = run_both(
        single(cls, **kw), faults, clip, micro=2, init_scale=2.0**12, growth_interval=3
    )
    assert_bitwise_equal(plain, mixed)
    assert_skip_accounting(plain, mixed, {4, 6})


def _variant_supported(cls: type, flag: str) -> str | None:
    """None when ``cls(..., **{flag: True})`` steps on CPU in this torch, else the reason."""
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    kw = {"lr": 0.1, flag: True}
    try:
        cls([p], **kw).step()
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        return f"{cls.__name__}({flag}=True) does not run on CPU in torch {torch.__version__}: {exc}"
    return None


@pytest.mark.parametrize("clip", [None, 0.25], ids=["noclip", "clip"])  # grad norms here are ~0.4
@pytest.mark.parametrize("flag", ["foreach", "fused"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_parity_foreach_and_fused(opt_name, flag, clip):
    cls, kw = OPTIMIZERS[opt_name]
    reason = _variant_supported(cls, flag)
    if reason:
        pytest.skip(reason)
    faults = (LossFault(2, INF), GradFault(5, "4.weight", NAN))
    _, plain, mixed = run_both(
        single(cls, **kw, **{flag: True}), faults, clip, init_scale=2.0**10, growth_interval=2
    )
    assert_bitwise_equal(plain, mixed)
    assert_skip_accounting(plain, mixed, {2, 5})


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [None, 0.25], ids=["noclip", "clip"])
@pytest.mark.parametrize("flag", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_parity_on_cuda(opt_name, flag, clip):
    """The same by-the-book GradScaler loop on a GPU: fused optimizers take GradScaler's in-kernel
    unscale path there (``_step_supports_amp_scaling``), mixprec unscales first; both must agree."""
    cls, kw = OPTIMIZERS[opt_name]
    variant = {"foreach": False} if flag == "for-loop" else {flag: True}
    faults = (LossFault(2, INF), GradFault(5, "4.weight", NAN), LossFault(6, NAN))
    _, plain, mixed = run_both(
        single(cls, **kw, **variant), faults, clip, device="cuda", init_scale=2.0**10, growth_interval=2
    )
    assert_bitwise_equal(plain, mixed)
    assert_skip_accounting(plain, mixed, {2, 5, 6})
    assert mixed.snapshots[-1]["0.weight"].device.type == "cuda"


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_parity_two_optimizers_partial_skip(opt_name):
    """inf in one optimizer's gradients: that one skips, the other steps, in both loops alike."""
    cls, kw = OPTIMIZERS[opt_name]
    fault_step = 3
    faults = (GradFault(fault_step, "4.weight", INF),)  # the last layer: the second optimizer
    _, plain, mixed = run_both(split_last_layer(cls, **kw), faults)
    assert_bitwise_equal(plain, mixed)
    assert_skip_accounting(plain, mixed, {fault_step})

    last_layer = {"4.weight", "4.bias"}
    for res in (plain, mixed):
        before, after = res.snapshots[fault_step - 1], res.snapshots[fault_step]
        for name in before:
            if name in last_layer:
                assert torch.equal(before[name], after[name]), f"{name} stepped despite inf gradient"
            else:
                assert not torch.equal(before[name], after[name]), f"{name} did not step"
    assert mixed.policy.stats.last_nonfinite_params == ["4.weight"]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_parity_two_optimizers_no_fault(opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    _, plain, mixed = run_both(split_last_layer(cls, **kw), (), init_scale=2.0**10, growth_interval=2)
    assert_bitwise_equal(plain, mixed)
    assert_skip_accounting(plain, mixed, set())
    assert mixed.scales[-1] > mixed.scales[0]  # the scale grew, identically on both sides


# ---------------------------------------------------------------------------------------- return value
def test_no_fault_never_skips():
    _, _, mixed = run_both(single(torch.optim.Adam, lr=1e-3))
    assert mixed.returned == [True] * STEPS
    assert mixed.policy.stats.skipped_steps == 0
    assert mixed.policy.stats.last_nonfinite_params == []


@pytest.mark.parametrize("fault_step", [0, 4, STEPS - 1])
def test_step_returns_false_exactly_at_the_fault(fault_step):
    _, _, mixed = run_both(single(torch.optim.SGD, lr=0.05, momentum=0.9), (LossFault(fault_step, INF),))
    assert mixed.returned == [i != fault_step for i in range(STEPS)]
    assert mixed.policy.stats.skipped_steps == 1
    assert mixed.policy.stats.last_skipped_step == fault_step


@pytest.mark.parametrize("param", ["0.weight", "2.weight", "2.bias", "4.bias"])
def test_last_nonfinite_params_names_the_injected_parameter(param):
    _, _, mixed = run_both(single(torch.optim.SGD, lr=0.05), (GradFault(3, param, NAN),))
    assert mixed.policy.stats.last_nonfinite_params == [param]
    assert mixed.policy.stats.as_dict()["last_nonfinite_params"] == [param]


def test_last_nonfinite_params_after_loss_fault_names_every_parameter():
    _, _, mixed = run_both(single(torch.optim.SGD, lr=0.05), (LossFault(2, INF),))
    names = [n for n, _ in make_mlp().named_parameters()]
    assert sorted(mixed.policy.stats.last_nonfinite_params) == sorted(names)


# ---------------------------------------------------------------------------------------- scale floor
def _inf_loss_step(policy: mixprec.Policy, model: nn.Module, opt, x, y) -> bool:
    with policy.autocast():
        loss = F.cross_entropy(model(x), y)
    policy.backward(loss * INF)
    ok = policy.step(opt)
    opt.zero_grad(set_to_none=True)
    return ok


def _floor_setup(**options):
    policy = mixprec.get_policy("fp16-mixed", device="cpu", **options)
    model = policy.prepare(make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ((x, y),) = make_batches(steps=1)[0]
    return policy, model, opt, x, y


def test_scale_collapse_raises_on_third_skip_at_floor():
    policy, model, opt, x, y = _floor_setup(init_scale=1024.0, min_scale=1024.0)
    before = _snapshot(model)
    with policy.precision_scope():
        assert _inf_loss_step(policy, model, opt, x, y) is False
        assert _inf_loss_step(policy, model, opt, x, y) is False
        with pytest.raises(mixprec.ScaleCollapseError) as info:
            _inf_loss_step(policy, model, opt, x, y)
    err = info.value
    assert isinstance(err, mixprec.MixprecError)
    assert err.parameters, "ScaleCollapseError.parameters must name the overflowing parameters"
    assert set(err.parameters) <= {n for n, _ in model.named_parameters()}
    assert "min_scale=1024.0" in str(err)
    assert policy.stats.skipped_steps == 3
    assert policy.scaler.get_scale() == 1024.0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])


def test_scale_collapse_counts_only_consecutive_skips():
    policy, model, opt, x, y = _floor_setup(init_scale=1024.0, min_scale=1024.0)
    with policy.precision_scope():
        assert not _inf_loss_step(policy, model, opt, x, y)
        assert not _inf_loss_step(policy, model, opt, x, y)
        with policy.autocast():
            loss = F.cross_entropy(model(x), y)
        policy.backward(loss)
        assert policy.step(opt)  # a good step at the floor resets the count
        opt.zero_grad(set_to_none=True)
        assert not _inf_loss_step(policy, model, opt, x, y)
        assert not _inf_loss_step(policy, model, opt, x, y)
    assert policy.stats.skipped_steps == 4


def test_scale_never_goes_below_min_scale():
    policy, model, opt, x, y = _floor_setup(init_scale=8.0, min_scale=2.0, max_skips_at_min_scale=10)
    seen = []
    with policy.precision_scope():
        for _ in range(6):
            assert not _inf_loss_step(policy, model, opt, x, y)
            seen.append(policy.scaler.get_scale())
    assert all(s >= 2.0 for s in seen)
    assert seen == [4.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert [s for _, s in policy.stats.scale_history] == seen


def test_default_min_scale_is_one():
    """GradScaler alone would halve the scale to 0.25 after 4 skips from 4.0; mixprec stops at 1.0."""
    policy, model, opt, x, y = _floor_setup(init_scale=4.0)
    with policy.precision_scope():
        for _ in range(3):
            _inf_loss_step(policy, model, opt, x, y)
        assert policy.scaler.get_scale() == 1.0
        assert policy.stats.skips_at_min_scale == 1
        _inf_loss_step(policy, model, opt, x, y)
        with pytest.raises(mixprec.ScaleCollapseError):
            _inf_loss_step(policy, model, opt, x, y)


# ---------------------------------------------------------------------------------------- bf16 guard
def _bf16_nan_grad_step(finite_check: bool):
    options = {"finite_check": True} if finite_check else {}
    policy = mixprec.get_policy("bf16-mixed", device="cpu", **options)
    model = policy.prepare(make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ((x, y),) = make_batches(steps=1)[0]
    before = _snapshot(model)
    with policy.precision_scope():
        with policy.autocast():
            loss = F.cross_entropy(model(x), y)
        policy.backward(loss)
        model[2].weight.grad[0, 0] = NAN
        ok = policy.step(opt)
    return policy, model, before, ok


def test_bf16_finite_check_skips_nonfinite_step():
    policy, model, before, ok = _bf16_nan_grad_step(finite_check=True)
    assert ok is False
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert policy.stats.skipped_steps == 1
    assert policy.stats.last_skipped_step == 0
    assert policy.stats.last_nonfinite_params == ["2.weight"]
    assert policy.scaler is None


def test_bf16_without_finite_check_lets_nan_into_weights():
    policy, model, _, ok = _bf16_nan_grad_step(finite_check=False)
    assert ok is True
    assert torch.isnan(model[2].weight).any()
    assert policy.stats.skipped_steps == 0


def test_bf16_finite_check_steps_normally_when_finite():
    policy = mixprec.get_policy("bf16-mixed", device="cpu", finite_check=True)
    model = policy.prepare(make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with policy.precision_scope():
        for ((x, y),) in make_batches(steps=3):
            with policy.autocast():
                loss = F.cross_entropy(model(x), y)
            policy.backward(loss)
            assert policy.step(opt) is True
            opt.zero_grad(set_to_none=True)
    assert policy.stats.steps == 3 and policy.stats.skipped_steps == 0
    assert math.isfinite(loss.item())


# ---------------------------------------------------------------------------------------- clipping contract
def _two_opt_clipped_update_norm(name: str, fault: bool, max_norm: float = 1e-3) -> tuple[float, float]:
    """(norm of the first optimizer's update at the step, norm of its unclipped gradient); SGD lr=1."""
    options = {"finite_check": True} if name == "bf16-mixed" else {}
    policy = mixprec.get_policy(name, device="cpu", **options)
    model = policy.prepare(make_mlp())
    opts = split_last_layer(torch.optim.SGD, lr=1.0)(model)
    first = list(opts[0].param_groups[0]["params"])
    ((x, y),) = make_batches(steps=1)[0]
    before = [p.detach().clone() for p in first]
    with policy.precision_scope():
        with policy.autocast():
            loss = F.cross_entropy(model(x), y)
        policy.backward(loss)
        scale = policy.scaler.get_scale() if policy.scaler is not None else 1.0
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in first])).item() / scale
        if fault:
            model[4].weight.grad[0, 0] = INF  # only the second optimizer's gradients
        ok = policy.step(opts, clip_grad_norm=max_norm)
    assert ok is (not fault)
    update = torch.linalg.vector_norm(
        torch.stack([(p - q).norm() for p, q in zip(first, before, strict=True)])
    ).item()
    return update, grad_norm


@pytest.mark.parametrize("name", ["fp16-mixed", "bf16-mixed"])
def test_clip_grad_norm_bounds_the_update_without_fault(name):
    update, grad_norm = _two_opt_clipped_update_norm(name, fault=False)
    assert grad_norm > 1e-2  # far above max_norm: the clip matters
    assert 0 < update <= 1e-3 * 1.001


@pytest.mark.parametrize("name", ["fp16-mixed", "bf16-mixed"])
def test_clip_grad_norm_bounds_the_update_of_optimizers_that_still_step(name):
    update, grad_norm = _two_opt_clipped_update_norm(name, fault=True)
    assert grad_norm > 1e-2
    assert update <= 1e-3 * 1.001, f"first optimizer stepped {update:.3g} with clip_grad_norm=1e-3"
