"""The fsdp2 export (torch's fully_shard) on one gloo rank, on CPU."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys

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


class _KeepNet(torch.nn.Module):
    """Linear blocks in ``.layers``, then a LayerNorm and a head: the keep_fp32 set ["head", "norm"]."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


@pytest.mark.parametrize(
    ("name", "keep", "units"),
    [
        ("bf16-true", ("head", "norm"), 2),
        ("bf16-mixed", ("head", "norm"), 1),  # *-mixed gathers the LayerNorm in fp32 on its own anyway
        ("bf16-true", ("layers.0",), 0),  # a block is a unit either way
        ("bf16-true", ("layers.*",), 0),
    ],
)
def test_the_header_counts_the_units_keep_fp32_adds_on_the_model(name, keep, units):
    """FSDP2 cannot mix dtypes in one unit (pytorch#156784): each fp32 island outside the blocks is a
    fully_shard unit of its own. Given the model, the header says how many the keep_fp32 set adds,
    counted from the plan with and without it (the fully_shard calls the code makes); tune's exports
    (export_all with the workload's model) say it too. Without the model it says what each costs."""
    from mixprec.distributed.fsdp2 import keep_fp32_units
    from mixprec.exports import export, export_all

    policy = mixprec.get_policy(name, device="cpu", keep_fp32=list(keep))
    plain = mixprec.get_policy(name, device="cpu")
    assert len(sharding_plan(_KeepNet(), policy)) - len(sharding_plan(_KeepNet(), plain)) == units
    assert keep_fp32_units(_KeepNet(), policy) == units

    candidate = mixprec.Candidate(name, keep_fp32=keep)
    header = " ".join(
        line.lstrip("# ")
        for line in export(candidate, "fsdp2", device="cpu", model=_KeepNet()).splitlines()
        if line.startswith("#")
    )
    said = {0: "no extra fully_shard unit", 1: "1 extra fully_shard unit", 2: "2 extra fully_shard units"}
    assert f"{said[units]} on your model" in header
    assert "pytorch#156784" in header
    tuned = export_all(candidate, device="cpu", model=_KeepNet())["fsdp2"].text
    assert tuned is not None and f"{said[units]} on your model" in " ".join(tuned.split())
    unmodelled = " ".join(export(candidate, "fsdp2", device="cpu").split())
    assert "up to one extra fully_shard unit per module it matches" in unmodelled


def test_the_true_export_says_its_stock_optimizer_keeps_half_state():
    """bf16-true under FSDP2: the shards are bf16 and the AdamW the export builds keeps exp_avg and
    exp_avg_sq in bf16 (lint's MP306); the comment above the optimizer line says so. Under
    bf16-mixed the shards, and so the state, are fp32, and no such comment is written."""
    from mixprec.exports import export

    true = run_fsdp2(mixprec.PolicyConfig("bf16-true", "cpu"))
    lines = export(mixprec.PolicyConfig("bf16-true", "cpu"), "fsdp2", device="cpu").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("optimizer = torch.optim.AdamW("))
    note = " ".join(line.lstrip("# ") for line in lines[at - 4 : at] if line.startswith("#"))
    assert "keeps its state (exp_avg, exp_avg_sq) in bf16" in note and "MP306" in note
    state = true.optimizer.state[true.model.layers[0][0].weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16

    mixed = run_fsdp2(mixprec.PolicyConfig("bf16-mixed", "cpu"))
    assert "MP306" not in export(mixprec.PolicyConfig("bf16-mixed", "cpu"), "fsdp2", device="cpu")
    assert mixed.optimizer.state[mixed.model.layers[0][0].weight]["exp_avg"].dtype == torch.float32


TORCHRUN_STEPS = 6
# What the script runs around the pasted export: the fill-ins (the model above, a batch per rank, a
# loss), hooks that record the weights each module computes with, and, after the export's loop,
# what each rank saw.
_BEFORE = """
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # the same initial weights on every rank, as a checkpoint would load them
model = _KeepNet()
seen = []  # (module, weight dtype, weight type) as it computes: after FSDP2's all-gather
for name in ("layers.0.0", "norm", "head"):
    model.get_submodule(name).register_forward_pre_hook(
        lambda m, args, name=name: seen.append((name, str(m.weight.dtype), type(m.weight).__name__))
    )
generator = torch.Generator().manual_seed(1 + rank)  # each rank its own batch
batch = (torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator))
loader = [batch] * STEPS
losses = []


def loss_fn(model, batch):
    loss = F.mse_loss(model(batch[0]).float(), batch[1])
    losses.append(loss.item())
    return loss
"""
_AFTER = """
full = {n: p.full_tensor() for n, p in model.named_parameters()}  # a collective: every rank
stored = {n: str(p.dtype) for n, p in model.named_parameters()}  # the shards' dtypes
digest = float(sum(t.double().sum() for t in full.values()))
record = {"losses": losses, "seen": seen, "stored": stored, "digest": digest, "units": [n for n, _ in groups]}
with open(sys.argv[1] + f"/rank{rank}.json", "w") as f:
    json.dump(record, f)
dist.barrier()
dist.destroy_process_group()
# Everything is written: leave without the interpreter's shutdown. In torch 2.14.1 gloo's worker
# thread can let go of the all-gathers above (their tensors' Python objects with them) after it
# began, which aborts the rank (SIGABRT, "terminate called without an active exception"; once in
# CI). destroy_process_group() does not join the workers while the FSDP2 model holds the group.
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_the_keep_fp32_export_trains_under_torchrun_on_two_ranks(tmp_path):
    """The bf16-true FSDP2 export with keep_fp32=["head", "norm"], run as a user runs it: pasted into
    a script and launched by torchrun on 2 gloo ranks (CPU), each rank on its own batch. Its header
    counts the 2 fully_shard units the islands add; the blocks compute with bf16 weights and the
    islands with fp32 ones (all-gathered: plain tensors, not shards), their shards stay fp32 and the
    blocks' bf16; both ranks' losses are finite and fall, and both end with the same weights. (The
    script leaves with os._exit once its results are written: see _AFTER, torch's gloo at exit.)"""
    from mixprec.exports import export

    candidate = mixprec.Candidate("bf16-true", keep_fp32=("head", "norm"))
    text = export(candidate, "fsdp2", device="cpu", model=_KeepNet())
    header = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    assert 'keep_fp32 ["head", "norm"]: 2 extra fully_shard units on your model' in header
    assert text.count("lr=1e-3)") == 1  # the optimizer line is yours: a rate that shows in 6 steps
    script = tmp_path / "train.py"
    script.write_text(
        "\n".join(
            [
                f"STEPS = {TORCHRUN_STEPS}",
                "import torch",
                inspect.getsource(_KeepNet),
                _BEFORE,
                text.replace("lr=1e-3)", "lr=1e-2)"),
                _AFTER,
            ]
        )
    )
    launcher = ["--standalone", "--nproc_per_node", "2"]  # standalone: a free port, chosen by torchrun
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launcher, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    for record in ranks:
        losses = record["losses"]
        assert len(losses) == TORCHRUN_STEPS and all(map(math.isfinite, losses)), losses
        assert losses[-1] < losses[0], losses
        computed = [("layers.0.0", "bfloat16"), ("norm", "float32"), ("head", "float32")]
        assert record["seen"] == [[m, f"torch.{d}", "Parameter"] for m, d in computed] * TORCHRUN_STEPS
        assert record["stored"]["head.weight"] == record["stored"]["norm.weight"] == "torch.float32"
        assert record["stored"]["layers.0.0.weight"] == "torch.bfloat16"
        assert record["units"] == ["layers.0", "layers.1", "norm", "head", ""]  # 2 beyond blocks + root
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank its own batch
    assert ranks[0]["digest"] == ranks[1]["digest"]  # one model: the same weights on both ranks
