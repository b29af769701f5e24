"""The fsdp2 export (torch's fully_shard) on one gloo rank, on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from harness import (
    CASES,
    FRAMEWORK_TOLERANCE,
    Net,
    accumulating,
    check_accumulation,
    counting_steps,
    micro_batches,
    run_case,
    run_fsdp2,
    with_sgd,
)
from torch.distributed.fsdp import fully_shard

import mixprec
from mixprec.distributed import shard_model, sharding_plan, support
from mixprec.errors import UnsupportedError

pytestmark = pytest.mark.usefixtures("one_rank")

# tf32: a CUDA math mode. channels_last: fully_shard refuses non-contiguous parameters.
REFUSED = {"tf32"} | {c for c in CASES if "+cl" in c}


@pytest.mark.parametrize("case", CASES)
def test_export_runs_the_policy(case):
    run_case("fsdp2", case, REFUSED, run_fsdp2)


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "bf16-true"])
def test_every_fully_shard_call_shards_onto_the_exported_device(policy, monkeypatch):
    """fully_shard's default mesh is the accelerator's: on a machine with a GPU, the export written
    for the CPU moved the model to CUDA and its first step met CPU batches (18 failures on the first
    GPU run, H200). Every call takes a mesh on the exported device, as shard_model's does."""
    import torch.distributed.fsdp as fsdp

    meshes = []

    def spy(module, *args, mesh=None, **kwargs):
        meshes.append(mesh)
        return fully_shard(module, *args, mesh=mesh, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", spy)
    run_fsdp2(mixprec.PolicyConfig(policy, "cpu"), edit=with_sgd)
    assert meshes and all(m is not None and m.device_type == "cpu" for m in meshes), meshes


def test_fully_shard_refuses_channels_last_parameters():
    """Why channels_last is refused under FSDP2."""
    model = Net().to(memory_format=torch.channels_last)
    with pytest.raises(NotImplementedError, match="non-contiguous parameters"):
        fully_shard(model)


def test_shard_model_refuses_channels_last_with_the_reason():
    policy = mixprec.get_policy("bf16-mixed", device="cpu", channels_last=True)
    verdict = support(policy, "fsdp2")
    assert not verdict and "channels_last" in verdict.reason
    model = policy.prepare(Net())
    with pytest.raises(UnsupportedError, match="non-contiguous"):
        shard_model(model, policy)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_accumulation_steps_once_per_effective_batch(policy):
    """set_requires_gradient_sync on the last of every 3 micro-batches of 4: every optimizer step sees 12
    samples, and the weights are the plain reference loop's (loss / 3 per micro-batch)."""
    source = accumulating(policy)
    with counting_steps():
        run = run_fsdp2(source, loader=micro_batches(), edit=with_sgd)
    check_accumulation(source, run, "fsdp2", **FRAMEWORK_TOLERANCE)


class _BatchNormNet(torch.nn.Module):
    """ResNet-like blocks in ``.layers``: a convolution after BatchNorm inside a block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        nn = torch.nn
        self.layers = nn.Sequential(
            nn.Sequential(
                nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1)
            ),
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 2))

    def forward(self, x):
        return self.head(self.layers(x))


def _norms(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}


def _fsdp_groups(model):
    """{module name: MixedPrecisionPolicy} of every module fully_shard wrapped."""
    from torch.distributed.fsdp import FSDPModule

    return {n: m._get_fsdp_state()._mp_policy for n, m in model.named_modules() if isinstance(m, FSDPModule)}


@pytest.mark.parametrize("name", ["bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"])
def test_the_export_shards_batch_norm_as_shard_model_does(name):
    """The fsdp2 export gives BatchNorm an fp32 group of its own, as mixprec's shard_model does (the
    same groups, the same MixedPrecisionPolicy each), and under *-true keeps its weights and running
    statistics fp32: a block gathered them in the low dtype (bf16 weights next to fp32 statistics
    under *-mixed, half statistics under *-true). BatchNorm takes the block's half inputs and returns
    them in that dtype, so the convolution after it in the same block runs."""
    from harness import execute

    from mixprec.exports import export

    generator = torch.Generator().manual_seed(1)
    loader = [
        (torch.randn(4, 3, 4, 4, generator=generator) * 100, torch.randint(0, 2, (4,), generator=generator))
        for _ in range(3)
    ]
    losses = []
    ran = []

    def loss_fn(model, batch):
        loss = torch.nn.functional.cross_entropy(model(batch[0]).float(), batch[1])
        losses.append(loss.item())
        return loss

    model = _BatchNormNet()
    initial = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    for norm in _norms(model).values():
        norm.register_forward_hook(
            lambda m, args, out: ran.append((m.weight.dtype, args[0].dtype == out.dtype))
        )
    config = mixprec.PolicyConfig(name, "cpu")
    ns = execute(with_sgd(export(config, "fsdp2")), {"model": model, "loader": loader, "loss_fn": loss_fn})

    assert ran and set(ran) == {(torch.float32, True)}, ran
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses
    low = mixprec.get_policy(name, device="cpu").spec.low_precision_dtype
    for n, norm in _norms(ns["model"]).items():
        for what, value in [*norm.named_parameters(), *norm.named_buffers()]:
            if value.is_floating_point():
                assert value.dtype == torch.float32, f"{n}.{what} is {value.dtype}"
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                assert torch.isfinite(full).all(), f"{n}.{what}: {full}"
    assert ns["model"].layers[0][0].weight.dtype == (low if "true" in name else torch.float32)
    for n, p in ns["model"].named_parameters():
        assert not torch.equal(p.full_tensor().float(), initial[n]), f"{n} did not train"

    policy = mixprec.get_policy(name, device="cpu")
    plan = {g.name: g.mp_policy for g in sharding_plan(policy.prepare(_BatchNormNet()), policy)}
    assert _fsdp_groups(ns["model"]) == plan


@pytest.mark.parametrize("name", ["bf16-true", "fp16-true"])
def test_shard_model_runs_a_convolution_after_batch_norm_under_true_policies(name):
    """BatchNorm's fp32 group cast its inputs to fp32 (cast_forward_inputs): the layer returned fp32
    and the half convolution after it in the same block failed ('Input type (float) and bias type
    ... should be the same'). It takes the half inputs now, as on one device."""
    policy = mixprec.get_policy(name, device="cpu")
    model = shard_model(policy.prepare(_BatchNormNet()), policy)
    x = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    with policy.autocast():
        out = model(x)
    assert out.dtype == policy.spec.param_dtype
    policy.backward(torch.nn.functional.cross_entropy(out.float(), torch.tensor([0, 1, 0, 1])))
    for norm in _norms(model).values():
        assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32


class _TiedLM(torch.nn.Module):
    """An embedding tied to the output head, repeated blocks in ``.layers`` between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)
        )
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("name", ["bf16-true"])
def test_the_export_refuses_keep_fp32_on_one_side_of_a_tied_weight_as_shard_model_does(name):
    """keep_fp32 on a head tied to the embedding under *-true: refused before sharding with mixprec's
    reason (refuse_split_ties, as Policy.prepare: the island fp32, the embedding bf16, one
    parameter). Before, FSDP2 sharded the tie in the head's group and the embedding failed. Without
    keep_fp32 the tie stays one parameter, sharded by the root's group, and trains. (*-mixed: the
    test below.)"""
    from harness import execute

    from mixprec.errors import PolicyError
    from mixprec.exports import export

    loader = [(torch.randint(0, 16, (2, 3)), torch.randint(0, 16, (2, 3))) for _ in range(2)]

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]).flatten(0, 1).float(), batch[1].flatten())

    policy = mixprec.get_policy(name, device="cpu", keep_fp32=["head"])
    with pytest.raises(PolicyError) as mixprecs:
        shard_model(policy.prepare(_TiedLM()), policy)
    config = mixprec.PolicyConfig(name, "cpu", keep_fp32=("head",))
    with pytest.raises(ValueError) as exported:
        execute(export(config, "fsdp2"), {"model": _TiedLM(), "loader": loader, "loss_fn": loss_fn})
    assert str(exported.value) == str(mixprecs.value)
    assert "tied weight" in str(exported.value)

    model = _TiedLM()
    ns = execute(
        export(mixprec.PolicyConfig(name, "cpu"), "fsdp2"),
        {"model": model, "loader": loader, "loss_fn": loss_fn},
    )
    assert ns["model"].head.weight is ns["model"].wte.weight
    assert set(_fsdp_groups(ns["model"])) == {"layers.0", "layers.1", ""}


def _tied_run(target: str, keep: tuple[str, ...]) -> dict:
    """Two SGD steps of _TiedLM through ``target``'s bf16-mixed export: losses, trained weights, model."""
    from harness import execute

    from mixprec.exports import export

    generator = torch.Generator().manual_seed(1)
    loader = [(torch.randint(0, 16, (2, 3), generator=generator),) * 2 for _ in range(2)]
    losses: list[torch.Tensor] = []

    def loss_fn(model, batch):
        loss = torch.nn.functional.cross_entropy(model(batch[0]).flatten(0, 1).float(), batch[1].flatten())
        losses.append(loss.detach())
        return loss

    text = with_sgd(export(mixprec.PolicyConfig("bf16-mixed", "cpu", keep_fp32=keep), target))
    ns = execute(text, {"model": _TiedLM(), "loader": loader, "loss_fn": loss_fn})
    params = {n: p.detach() for n, p in ns["model"].named_parameters()}
    if target == "fsdp2":
        params = {n: p.full_tensor() for n, p in params.items()}
    return {"losses": losses, "params": params, "model": ns["model"]}


def test_bf16_mixed_keeps_a_tied_head_fp32_as_one_device_does():
    """Issue 39: bf16-mixed with keep_fp32=['head'] on a head tied to the embedding was refused by
    the export and shard_model ("cannot be fp32 in one and low precision in the other"), which is
    false under *-mixed: every weight is fp32 on one device and autocast casts per op. Left to the
    root's group, gathered in fp32, the export trains bit for bit as the pytorch export on one device,
    and shard_model makes the same groups."""
    one, fsdp = _tied_run("pytorch", ("head",)), _tied_run("fsdp2", ("head",))
    assert len(one["losses"]) == 2 and all(map(torch.equal, one["losses"], fsdp["losses"]))
    for name, value in one["params"].items():
        assert torch.equal(value, fsdp["params"][name]), name
    model = fsdp["model"]
    assert model.head.weight is model.wte.weight
    groups = _fsdp_groups(model)
    assert "head" not in groups and groups[""].param_dtype == torch.float32  # the root holds the tie
    policy = mixprec.get_policy("bf16-mixed", device="cpu", keep_fp32=["head"])
    assert groups == {g.name: g.mp_policy for g in sharding_plan(policy.prepare(_TiedLM()), policy)}
    sharded = shard_model(policy.prepare(_TiedLM()), policy)
    assert sharded.head.weight is sharded.wte.weight


def test_the_bf16_mixed_export_runs_a_gpt_as_one_device_does():
    """The bf16-mixed fsdp2 export on tests/distributed/test_fsdp2_numerics.py's tiny GPT (token and
    position embeddings, LayerNorm, Linear blocks, a head tied to the embedding) against the
    pytorch export of the same policy on one device: every op of forward and backward runs with the
    same dtypes (FSDP2's all-gather copies and views aside), and the losses of two SGD steps and the
    trained weights are equal bit for bit. The export pastes autocast_fp32_params, gathers the norms
    and embeddings in fp32 groups, keeps the root (it holds the tied embedding) fp32 and casts no
    group's inputs, as shard_model does."""
    from harness import execute

    from distributed.test_fsdp2_numerics import CONFIG, _diff, _gpt, _OpDtypes
    from mixprec.exports import export

    def run(target: str) -> dict:
        text = with_sgd(export(mixprec.PolicyConfig("bf16-mixed", "cpu"), target))
        if target == "fsdp2":
            assert text.count("list(model.layers)") == 1
            text = text.replace("list(model.layers)", "list(model.transformer.h)")
        assert text.count("    loss.backward()\n") == 1  # record backward too
        text = text.replace("    loss.backward()\n", "    with recorder:\n        loss.backward()\n")
        generator = torch.Generator().manual_seed(1)
        loader = [torch.randint(0, CONFIG.vocab_size, (2, 8), generator=generator) for _ in range(2)]
        recorder, losses = _OpDtypes(), []

        def loss_fn(model, idx):
            with recorder:
                loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            losses.append(loss.detach())
            return loss

        ns = execute(text, {"model": _gpt(), "loader": loader, "loss_fn": loss_fn, "recorder": recorder})
        params = {n: p.detach() for n, p in ns["model"].named_parameters()}
        if target == "fsdp2":
            params = {n: p.full_tensor() for n, p in params.items()}
        return {"ops": dict(recorder.seen), "losses": losses, "params": params, "model": ns["model"]}

    one, fsdp = run("pytorch"), run("fsdp2")
    assert _diff(one, fsdp) == {}
    assert (("torch.float32",), ("torch.float32",)) in fsdp["ops"]["embedding"]
    assert {out for _, out in fsdp["ops"]["addmm"]} == {("torch.bfloat16",)}
    assert len(one["losses"]) == 2 and all(map(torch.equal, one["losses"], fsdp["losses"]))
    for name, value in one["params"].items():
        assert torch.equal(value, fsdp["params"][name]), name
    model = fsdp["model"]
    assert model.lm_head.weight is model.transformer.wte.weight
    policy = mixprec.get_policy("bf16-mixed", device="cpu")
    assert _fsdp_groups(model) == {g.name: g.mp_policy for g in sharding_plan(_gpt(), policy)}
