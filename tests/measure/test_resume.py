"""Checkpoint/resume: k steps, save, load into fresh objects, m more steps == k+m straight steps, bitwise."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

K, M = 3, 4
INF = float("inf")
NAN = float("nan")


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here trains tiny models: one thread (see conftest.single_thread)."""


def make_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


def make_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def train(policy, model, opt, batches, first_step: int, faults: dict[int, str]) -> list[bool]:
    """Train on ``batches`` (global step numbers start at ``first_step``); faults: step -> 'loss'|'grad'."""
    returned = []
    with policy.precision_scope():
        for i, (x, y) in enumerate(batches):
            step = first_step + i
            with policy.autocast():
                loss = F.cross_entropy(model(x), y)
            if faults.get(step) == "loss":
                loss = loss * INF
            policy.backward(loss)
            if faults.get(step) == "grad":
                with torch.no_grad():
                    model[2].weight.grad[0, 0] = NAN
            returned.append(policy.step(opt))
            opt.zero_grad(set_to_none=True)
    return returned


def build(name: str, base: nn.Module, **options):
    policy = mixprec.get_policy(name, device="cpu", **options)
    model = policy.prepare(copy.deepcopy(base))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return policy, model, opt


def run_straight_and_resumed(tmp_path, name: str, faults: dict[int, str], **options):
    base = make_mlp()
    batches = make_batches(K + M)

    p_straight, m_straight, o_straight = build(name, base, **options)
    ret_straight = train(p_straight, m_straight, o_straight, batches, 0, faults)

    p1, m1, o1 = build(name, base, **options)
    ret_first = train(p1, m1, o1, batches[:K], 0, faults)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": m1.state_dict(), "opt": o1.state_dict(), "policy": p1.state_dict()}, path)
    del p1, m1, o1

    # Fresh objects: a different init that the checkpoint must overwrite.
    p2, m2, o2 = build(name, make_mlp(seed=123), **options)
    ckpt = torch.load(path, weights_only=True)
    m2.load_state_dict(ckpt["model"])
    o2.load_state_dict(ckpt["opt"])
    p2.load_state_dict(ckpt["policy"])
    assert p2.stats.steps == K
    ret_second = train(p2, m2, o2, batches[K:], K, faults)

    assert ret_first + ret_second == ret_straight
    for (name_a, a), (name_b, b) in zip(m_straight.named_parameters(), m2.named_parameters(), strict=True):
        assert name_a == name_b
        assert torch.equal(a, b), f"{name_a} differs between straight and resumed runs"
    return p_straight, p2, o_straight, o2, ret_straight


def test_resume_fp16_mixed_bitwise(tmp_path):
    # growth_interval=2 makes the growth tracker (saved in the scaler state) decide the scale after resume.
    options = {"init_scale": 2.0**10, "growth_interval": 2}
    p_straight, p_resumed, o_straight, o_resumed, returned = run_straight_and_resumed(
        tmp_path, "fp16-mixed", {1: "loss"}, **options
    )
    assert returned == [True, False, True, True, True, True, True]
    assert p_resumed.scaler.get_scale() == p_straight.scaler.get_scale()
    assert p_resumed.scaler._get_growth_tracker() == p_straight.scaler._get_growth_tracker()
    assert p_resumed.stats.steps == p_straight.stats.steps == K + M
    assert p_resumed.stats.skipped_steps == p_straight.stats.skipped_steps == 1
    assert p_resumed.stats.last_skipped_step == p_straight.stats.last_skipped_step == 1
    assert p_resumed.stats.scale_history == p_straight.stats.scale_history
    assert p_resumed.stats.as_dict() == p_straight.stats.as_dict()
    # The scale went down once and grew back: the checkpoint carried real scaler state.
    scales = [s for _, s in p_straight.stats.scale_history]
    assert min(scales) < scales[-1]
    state_a, state_b = o_straight.state_dict()["state"], o_resumed.state_dict()["state"]
    for idx in state_a:
        for key in state_a[idx]:
            assert torch.equal(state_a[idx][key], state_b[idx][key]), (idx, key)


def test_resume_fp16_mixed_with_grad_fault_after_resume(tmp_path):
    p_straight, p_resumed, *_ = run_straight_and_resumed(tmp_path, "fp16-mixed", {0: "grad", 5: "grad"})
    assert p_resumed.stats.skipped_steps == p_straight.stats.skipped_steps == 2
    assert p_resumed.stats.last_nonfinite_params == ["2.weight"]
    assert p_resumed.scaler.get_scale() == p_straight.scaler.get_scale() == 2.0**14


def test_resume_bf16_mixed_bitwise(tmp_path):
    p_straight, p_resumed, _, _, returned = run_straight_and_resumed(
        tmp_path, "bf16-mixed", {2: "grad"}, finite_check=True
    )
    assert returned == [True, True, False, True, True, True, True]
    assert p_resumed.scaler is None
    assert p_resumed.state_dict()["scaler"] is None
    assert p_resumed.stats.steps == K + M
    assert p_resumed.stats.skipped_steps == p_straight.stats.skipped_steps == 1
    assert p_resumed.stats.last_skipped_step == 2
    assert p_resumed.stats.as_dict() == p_straight.stats.as_dict()


def test_load_state_dict_from_other_policy_raises():
    bf16 = mixprec.get_policy("bf16-mixed", device="cpu")
    fp16 = mixprec.get_policy("fp16-mixed", device="cpu")
    with pytest.raises(mixprec.PolicyError, match=re.escape("'bf16-mixed'")) as info:
        fp16.load_state_dict(bf16.state_dict())
    assert "'fp16-mixed'" in str(info.value)
    # Nothing was loaded.
    assert fp16.stats.steps == 0


def test_load_state_dict_roundtrips_through_torch_save(tmp_path):
    policy = mixprec.get_policy("fp16-mixed", device="cpu", init_scale=512.0, growth_interval=7)
    path = tmp_path / "policy.pt"
    torch.save(policy.state_dict(), path)
    fresh = mixprec.get_policy("fp16-mixed", device="cpu")
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert fresh.scaler.state_dict() == policy.scaler.state_dict()
    assert fresh.scaler.get_growth_interval() == 7
