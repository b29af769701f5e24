"""Per step, a Policy runs the ops a plain torch.amp loop runs, and nothing per parameter more.

Every aten op of one training step is logged (a TorchDispatchMode sees each kernel call, so a
per-parameter Python loop or a second pass over the gradients shows up as ops, on any device and
without timing). The plain loop is the one the PyTorch AMP recipe writes by hand."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _plain_step(model: nn.Module, dtype: torch.dtype, optimizer_name: str, clip: float | None):
    optimizer = _optimizer(model, optimizer_name)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _policy_step(model: nn.Module, policy: mixprec.Policy, optimizer_name: str, clip: float | None):
    model = policy.prepare(model)
    optimizer = _optimizer(model, optimizer_name)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with policy.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        policy.backward(loss)
        policy.step(optimizer, clip_grad_norm=clip)
        optimizer.zero_grad(set_to_none=True)

    return step, model


def _ops_of_one_step(step, x: torch.Tensor, y: torch.Tensor) -> collections.Counter[str]:
    step(x, y)  # the optimizer's state is made on the first step: log a later one
    log = _OpLog()
    with log:
        step(x, y)
    return log.ops


def _extra_ops(policy: mixprec.Policy, dtype: torch.dtype, optimizer: str, clip: float | None):
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    base = _model()
    plain = _ops_of_one_step(_plain_step(copy.deepcopy(base), dtype, optimizer, clip), x, y)
    ours = _ops_of_one_step(_policy_step(copy.deepcopy(base), policy, optimizer, clip)[0], x, y)
    return dict(ours - plain), dict(plain - ours)


@pytest.mark.parametrize(("optimizer", "clip"), [("sgd", None), ("adamw", 1.0)])
def test_a_bf16_mixed_step_runs_exactly_the_plain_loops_ops(optimizer, clip):
    assert _extra_ops(mixprec.get_policy("bf16-mixed", device="cpu"), torch.bfloat16, optimizer, clip) == (
        {},
        {},
    )


@pytest.mark.parametrize(
    ("optimizer", "clip", "reads"),
    [
        # GradScaler's step reads the inf flag; the policy counts the skip from that same read (a
        # second read of the flag on the H200 waited for the optimizer's kernels queued behind it)
        ("sgd", None, {}),
        # clipping: the policy reads the norm clip_grad_norm_ computes (one read), not the flag again
        ("adamw", 1.0, {"_local_scalar_dense": 1}),
    ],
)
def test_an_fp16_mixed_step_reads_the_inf_flag_once_and_keeps_one_scalar_copy(optimizer, clip, reads):
    # The copy is the scale kept for the history, device-side. Nothing per parameter.
    policy = mixprec.get_policy("fp16-mixed", device="cpu")
    extra, missing = _extra_ops(policy, torch.float16, optimizer, clip)
    assert extra == {**reads, "detach": 1, "clone": 1}
    assert missing == {}


def test_the_finite_check_with_clipping_reads_the_clips_norm_instead_of_a_second_pass():
    # finite_check=True: a step with inf/NaN gradients is skipped. With clipping the clip's own norm
    # is that check; the old code ran GradScaler's fused check over every gradient besides it.
    policy = mixprec.get_policy("bf16-mixed", device="cpu", finite_check=True)
    extra, missing = _extra_ops(policy, torch.bfloat16, "adamw", 1.0)
    assert extra == {"_local_scalar_dense": 1}
    assert missing == {}


def _two_steps_then_weights(step, model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(1)
    for _ in range(2):
        step(torch.randn(4, 16), torch.randn(4, 16))
    return [p.detach().clone() for p in model.parameters()]


def test_the_finite_check_with_clipping_leaves_the_plain_loops_weights_bit_for_bit():
    base = _model()
    plain_model = copy.deepcopy(base)
    plain = _two_steps_then_weights(_plain_step(plain_model, torch.bfloat16, "adamw", 0.05), plain_model)
    policy = mixprec.get_policy("bf16-mixed", device="cpu", finite_check=True)
    step, model = _policy_step(copy.deepcopy(base), policy, "adamw", 0.05)
    ours = _two_steps_then_weights(step, model)
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert policy.stats.skipped_steps == 0


def _set_grads(model: nn.Module, fill) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = fill(i, p)


def test_a_nonfinite_gradient_still_skips_only_its_optimizer_and_names_it():
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    reference = copy.deepcopy(second)
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_second, opt_reference = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (second, reference))
    policy = mixprec.get_policy("bf16-mixed", device="cpu", finite_check=True)
    policy.prepare(nn.ModuleDict({"first": first, "second": second}))
    before_first = [p.detach().clone() for p in first.parameters()]
    _set_grads(first, lambda i, p: torch.full_like(p, float("nan") if i == 0 else 1.0))
    for model in (second, reference):
        _set_grads(model, lambda i, p: torch.full_like(p, 3.0))

    assert policy.step([opt_first, opt_second], clip_grad_norm=1.0) is False

    # The finite optimizer is clipped by its own gradients' norm, exactly as clip_grad_norm_ would.
    nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    opt_reference.step()
    assert all(torch.equal(a, b) for a, b in zip(second.parameters(), reference.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), before_first, strict=True))
    assert policy.stats.last_nonfinite_params == ["first.weight"]


def test_finite_gradients_whose_norm_overflows_are_stepped_as_clip_grad_norm_steps_them():
    # A norm can overflow fp32 from finite gradients (squares above 3.4e38): that is no reason to
    # skip. The exact check finds them finite and the step is the plain loop's (clipped to zero).
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    reference = copy.deepcopy(model)
    opt, opt_reference = (
        torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1) for m in (model, reference)
    )
    policy = mixprec.get_policy("bf16-mixed", device="cpu", finite_check=True)
    policy.prepare(model)
    for m in (model, reference):
        _set_grads(m, lambda i, p: torch.full_like(p, 1e30))

    assert policy.step(opt, clip_grad_norm=1.0) is True

    nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    opt_reference.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_the_inf_flag_a_step_read_does_not_outlive_its_scale_update():
    """GradScaler's step keeps the flag it read for the policy's count; a clipped step never asks for
    it (it reads the clip's norm instead), so the kept flag must end with the step's scale update, or
    a later optimizer reusing the same id() would be told a stale skip."""
    policy = mixprec.get_policy("fp16-mixed", device="cpu")
    step, _ = _policy_step(_model(), policy, "sgd", 1.0)
    step(torch.randn(4, 16), torch.randn(4, 16))
    assert policy.scaler._found_read == {}
