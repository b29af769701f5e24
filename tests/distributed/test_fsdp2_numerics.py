"""FSDP2 under a *-mixed policy computes what one device computes (issue 26).

The zoo's GPT (token and position embeddings, LayerNorm, attention and MLP Linears, a residual
stream, a head tied to the embedding), shrunk to a few thousand parameters, trains one step under
bf16-mixed on one device and under :func:`shard_model` on a world of one gloo rank (in this
process, from a FileStore). A TorchDispatchMode records every aten op of forward and backward with
the dtypes of its floating-point inputs and of its outputs; every op the single-device run calls
must run with the same dtypes under FSDP2 (ops only FSDP2 calls, its all-gather copies and views,
are its own). Before the fix FSDP2 all-gathered the norms and embeddings in bf16 and cast every
block's input to bf16, so the residual stream, LayerNorm and the embeddings ran in bf16.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mixprec
from mixprec.distributed import fsdp_mp_policy, shard_model, sharding_plan
from mixprec.workload.zoo import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=16)
# What only FSDP2 calls around the model's own ops (all-gather buffers, views, copies in and out).
FSDP_ONLY = {
    "_record_function_enter_new",
    "_record_function_exit",
    "as_strided",
    "chunk_cat",
    "copy_",
    "empty",
}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny tensors: one thread (see tests/conftest.single_thread)."""


class _OpDtypes(TorchDispatchMode):
    """op name -> {(floating-point input dtypes, output dtypes)} over everything run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[tuple[tuple[str, ...], tuple[str, ...]]]] = collections.defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))

        def dtypes(tree, floating: bool) -> tuple[str, ...]:
            leaves = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
            return tuple(str(t.dtype) for t in leaves if t.is_floating_point() or not floating)

        self.seen[func.overloadpacket.__name__].add((dtypes((args, kwargs), True), dtypes(out, False)))
        return out


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _one_step(policy_name: str, *, sharded: bool) -> dict:
    policy = mixprec.get_policy(policy_name, device="cpu")
    model = policy.prepare(_gpt())
    if sharded:
        shard_model(model, policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    idx = torch.randint(0, CONFIG.vocab_size, (2, 8))
    recorder = _OpDtypes()
    with recorder:
        with policy.autocast():
            loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        policy.backward(loss)
    policy.step(opt)

    def full(p: torch.Tensor) -> torch.Tensor:
        return p.detach().full_tensor() if sharded else p.detach()

    return {
        "ops": dict(recorder.seen),
        "loss": loss.detach(),
        "params": {n: full(p).clone() for n, p in model.named_parameters()},
    }


def _diff(one: dict, fsdp: dict) -> dict[str, tuple[set, set]]:
    """The ops the single-device run calls whose dtypes differ under FSDP2, and FSDP2's unknown ops."""
    one, fsdp = one["ops"], fsdp["ops"]
    ops = {op for op in one if one[op] != fsdp.get(op, set())}
    ops |= {op for op in fsdp if op not in one and op not in FSDP_ONLY}
    return {op: (one.get(op, set()), fsdp.get(op, set())) for op in sorted(ops)}


def test_bf16_mixed_gpt_runs_the_single_device_op_dtypes_under_fsdp2(one_gloo_rank):
    one = _one_step("bf16-mixed", sharded=False)
    fsdp = _one_step("bf16-mixed", sharded=True)
    assert _diff(one, fsdp) == {}
    # The Linears still compute in bf16 (FSDP2 all-gathers their weights in bf16, as autocast would
    # cast them), LayerNorm and the embeddings in fp32.
    assert (("torch.float32",), ("torch.float32",)) in fsdp["ops"]["embedding"]
    assert {out for _, out in fsdp["ops"]["addmm"]} == {("torch.bfloat16",)}
    # Same dtypes, same values: one rank reproduces the single-device step bit for bit.
    assert torch.equal(one["loss"], fsdp["loss"])
    for name, value in one["params"].items():
        assert torch.equal(value, fsdp["params"][name]), name


def test_bf16_mixed_plan_keeps_norms_and_embeddings_fp32():
    """The plan that gives those dtypes: blocks in bf16 without casting their inputs (autocast does
    the casting, so the residual stream stays fp32), LayerNorms and the position embedding fp32
    groups of their own, and the root fp32 because it holds the embedding tied to the head."""
    model = _gpt()
    policy = mixprec.get_policy("bf16-mixed", device="cpu")
    plan = {g.name: (g.role, g.mp_policy.param_dtype) for g in sharding_plan(model, policy)}
    assert plan == {
        "transformer.h.0.ln_1": ("autocast fp32", torch.float32),
        "transformer.h.0.ln_2": ("autocast fp32", torch.float32),
        "transformer.h.1.ln_1": ("autocast fp32", torch.float32),
        "transformer.h.1.ln_2": ("autocast fp32", torch.float32),
        "transformer.h.0": ("block", torch.bfloat16),
        "transformer.h.1": ("block", torch.bfloat16),
        "transformer.wpe": ("autocast fp32", torch.float32),
        "transformer.ln_f": ("autocast fp32", torch.float32),
        "": ("root", torch.float32),  # wte, tied to lm_head: an embedding
    }
    assert not any(g.mp_policy.cast_forward_inputs for g in sharding_plan(model, policy))
    assert not fsdp_mp_policy("bf16-mixed").cast_forward_inputs
    # *-true stores every weight (norms and embeddings included) in bf16: nothing to keep fp32.
    true = mixprec.get_policy("bf16-true", device="cpu")
    plan = {g.name: g.mp_policy.param_dtype for g in sharding_plan(model, true)}
    assert plan == {"transformer.h.0": torch.bfloat16, "transformer.h.1": torch.bfloat16, "": torch.bfloat16}


class _Scaled(nn.Module):
    """A block that uses a parameter of its own directly (a learned residual scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.fc(x)


def test_bf16_mixed_plan_gathers_only_linear_and_conv_weights_in_bf16():
    """Autocast casts Linear and conv weights itself; a parameter a module uses directly it does
    not, so the group holding it is fp32 (here the block: it cannot hand its own parameter to a
    group inside it), while the plain Linear blocks stay bf16."""
    model = nn.Sequential(_Scaled(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Conv1d(4, 4, 1))
    plan = sharding_plan(model, mixprec.get_policy("bf16-mixed", device="cpu"))
    assert {g.name: (g.role, g.mp_policy.param_dtype) for g in plan} == {
        "0": ("block", torch.float32),
        "1": ("block", torch.bfloat16),
        "2": ("block", torch.bfloat16),
        "": ("root", torch.bfloat16),
    }
