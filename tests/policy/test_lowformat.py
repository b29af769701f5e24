"""The precision map of the low-format Linear policies (fp8, mxfp8, nvfp4): its validation, which
Linear GEMMs a map leaves in the format, the conversion (parameters, ties and optimizers kept),
and that a converted model trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from extras import require
from mixprec.errors import PolicyError
from mixprec.policy import Candidate
from mixprec.policy.blockscale import DIRECTIONS, BlockLinear
from mixprec.policy.lowformat import LayerPlan, convert, parse_entry, plan_layers, unmatched, validate_map
from mixprec.policy.registry import spec_of

require("torchao", "fp8")  # fails, not skips, under make test (MIXPREC_REQUIRE_FRAMEWORKS=1)

ALL = frozenset(DIRECTIONS)


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread is faster on a shared CPU."""


# ---------------------------------------------------------------------------- validation
def test_parse_entry():
    assert parse_entry("h.0.mlp:wgrad") == ("h.0.mlp", "wgrad")
    assert parse_entry("head") == ("head", None)
    assert parse_entry("blocks.*:forward") == ("blocks.*", "forward")
    for bad in ("head:bwd", "head:", ":wgrad", "head:Wgrad"):
        with pytest.raises(PolicyError, match="GEMM direction"):
            parse_entry(bad)


def test_a_map_on_a_policy_without_a_low_format_is_refused():
    with pytest.raises(PolicyError, match="bf16-mixed") as info:
        Candidate("bf16-mixed", keep_bf16=("head",))
    assert "keep_fp32" in str(info.value)  # names what the user may have meant
    with pytest.raises(PolicyError, match="precision map"):
        mixprec.get_policy("bf16-mixed", device="cpu", keep_bf16=["head"])
    with pytest.raises(PolicyError):
        Candidate("fp32", keep_bf16=("head",))
    assert Candidate("bf16-mixed", keep_bf16=()).keep_bf16 == ()  # an empty map is no map


def test_a_direction_needs_a_block_format():
    with pytest.raises(PolicyError, match="fp8-rowwise") as info:
        Candidate("fp8-rowwise", keep_bf16=("head:wgrad",))
    assert "mxfp8" in str(info.value)
    assert Candidate("fp8-rowwise", keep_bf16=("head",)).keep_bf16 == ("head",)  # whole layers: fine
    for policy in ("mxfp8", "nvfp4"):
        assert Candidate(policy, keep_bf16=("head:wgrad", "up")).keep_bf16 == ("head:wgrad", "up")


def test_unknown_directions_and_malformed_maps_are_refused():
    with pytest.raises(PolicyError, match="'head:backward'"):
        Candidate("mxfp8", keep_bf16=("head:backward",))
    for bad in (5, ["head", ""], [None], {"head": 1}):
        with pytest.raises(PolicyError, match="keep_bf16 must be"):
            validate_map(spec_of("mxfp8"), bad)
    assert validate_map(spec_of("nvfp4"), "head") == ("head",)  # one name, as keep_fp32 takes it
    assert Candidate("nvfp4", keep_bf16=["a", "b:dgrad"]).keep_bf16 == ("a", "b:dgrad")  # a tuple


def test_candidate_label_dict_and_policy_carry_the_map():
    cand = Candidate("mxfp8", keep_bf16=("head",))
    assert cand.label == "mxfp8+bf16[head]"
    both = Candidate("nvfp4", keep_fp32=("norm",), keep_bf16=("head", "mix:wgrad"))
    assert both.label == "nvfp4+fp32[norm]+bf16[head,mix:wgrad]"
    for c in (cand, both, Candidate("fp8-rowwise")):
        data = c.to_dict()
        assert data["keep_bf16"] == list(c.keep_bf16)
        assert Candidate.from_dict(data) == c
    old = cand.to_dict()
    del old["keep_bf16"]  # a result written before the map existed
    assert Candidate.from_dict(old).keep_bf16 == ()
    assert cand != Candidate("mxfp8") and hash(cand) != hash(Candidate("mxfp8"))

    policy = mixprec.get_policy(both, device="cpu", check=False)
    assert policy.config.keep_bf16 == ("head", "mix:wgrad")
    assert policy.config.keep_fp32 == ("norm",)
    assert policy.config.to_dict()["keep_bf16"] == ["head", "mix:wgrad"]
    with pytest.raises(PolicyError, match="keep_bf16"):
        mixprec.get_policy(both, device="cpu", check=False, keep_bf16=["up"])  # given twice
    plain = mixprec.get_policy("mxfp8", device="cpu", check=False, keep_bf16=["head:dgrad"])
    assert plain.config.keep_bf16 == ("head:dgrad",)


# ---------------------------------------------------------------------------- plan and convert
class Net(nn.Module):
    """Every kind of Linear a plan sorts: eligible ones, a frozen one, one mxfp8 cannot take (48
    features), one no format takes (40), an fp32 island, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.blocks = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])
        self.frozen = nn.Linear(64, 64).requires_grad_(False)
        self.odd = nn.Linear(64, 48)
        self.tiny = nn.Linear(48, 40)
        self.island = nn.Sequential(nn.Linear(40, 32))
        self.head = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        for block in self.blocks:
            h = torch.relu(block(h))
        h = torch.relu(self.odd(torch.relu(self.frozen(h))))
        return self.head(torch.relu(self.island(torch.relu(self.tiny(h)))))


def fresh() -> Net:
    torch.manual_seed(0)
    return Net()


def test_plan_layers_sorts_every_linear():
    model = fresh()
    entries = ["head", "blocks.*:wgrad", "up:forward"]
    plan = plan_layers(model, spec_of("mxfp8"), keep_fp32=["island"], keep_bf16=entries)
    assert plan.low == {
        "up": frozenset({"dgrad", "wgrad"}),
        "blocks.0": frozenset({"forward", "dgrad"}),
        "blocks.1": frozenset({"forward", "dgrad"}),
        "frozen": ALL,  # a frozen weight runs no wgrad, but the plan names what may run in the format
    }
    assert plan.kept == ["head"]
    assert plan.ineligible == ["odd", "tiny"]  # 48 is no multiple of 32; 40 of neither 32 nor 16
    assert "island.0" not in {*plan.low, *plan.kept, *plan.ineligible}  # fp32 by design
    assert plan.describe() == ["head", "up:forward", "blocks.0:wgrad", "blocks.1:wgrad"]

    nv = plan_layers(model, spec_of("nvfp4"), keep_fp32=["island"])
    assert list(nv.low) == ["up", "blocks.0", "blocks.1", "frozen", "odd", "head"]
    assert nv.ineligible == ["tiny"] and nv.kept == [] and nv.describe() == []
    assert all(dirs == ALL for dirs in nv.low.values())

    fp8 = plan_layers(model, spec_of("fp8-rowwise"), keep_bf16=["blocks.*", "head"])
    assert fp8.kept == ["blocks.0", "blocks.1", "head"]
    assert list(fp8.low) == ["up", "frozen", "odd"]
    assert fp8.ineligible == ["tiny", "island.0"]  # no island given: listed like any other Linear

    # every direction kept one by one is the layer kept whole
    whole = plan_layers(model, spec_of("nvfp4"), keep_bf16=["up:forward", "up:dgrad", "u?:wgrad"])
    assert "up" in whole.kept and "up" not in whole.low


def test_unmatched_entries():
    model = fresh()
    assert unmatched(model, ["head", "blocks.*:wgrad", "island.0"]) == []
    assert unmatched(model, ["haed", "blocks.9", "up:dgrad", "island"]) == ["haed", "blocks.9", "island"]


@pytest.mark.parametrize("policy", ["mxfp8", "nvfp4"])
def test_convert_swaps_what_the_plan_says_and_keeps_the_parameters(policy):
    model = fresh()
    before = dict(model.named_parameters())
    frozen_flags = {n: p.requires_grad for n, p in before.items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # built before prepare, as users do
    pol = mixprec.get_policy(
        policy, device="cpu", check=False, keep_fp32=["island"], keep_bf16=["head", "blocks.1:dgrad"]
    )
    model = pol.prepare(model)
    plan = pol.layer_plan
    assert isinstance(plan, LayerPlan) and pol.fp8_layers == list(plan.low)
    modules = dict(model.named_modules())
    for name, low in plan.low.items():
        assert type(modules[name]) is BlockLinear and modules[name].low == low, name
    assert modules["blocks.1"].low == frozenset({"forward", "wgrad"})
    for name in (*plan.kept, *plan.ineligible, "island.0"):
        assert type(modules[name]) is nn.Linear, name
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, param in after.items():
        assert param is before[name], name  # the very objects: optimizer, ties and state dict hold
        assert param.requires_grad == frozen_flags[name]
    assert set(model.state_dict()) == set(fresh().state_dict())

    snapshot = {n: p.detach().clone() for n, p in after.items()}
    x = torch.randn(8, 32)
    with pol.precision_scope():
        with pol.autocast():
            loss = model(x).float().pow(2).mean()
        pol.backward(loss)
        pol.step(optimizer)
    for name, param in after.items():
        moved = not torch.equal(param.detach(), snapshot[name])
        assert moved == frozen_flags[name], name  # every trainable weight stepped; frozen ones stayed
    assert model.frozen.weight.grad is None


def _tied() -> nn.Module:
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.a = nn.Linear(32, 32)
            self.b = nn.Linear(32, 32)
            self.b.weight = self.a.weight  # two Linears, one weight
            self.head = nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight  # an LM head tied to its embedding

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            return self.head(torch.relu(self.b(torch.relu(self.a(h)))))

    return Tied()


@pytest.mark.parametrize("policy", ["mxfp8", "nvfp4", "fp8-rowwise"])
def test_tied_weights_stay_tied_after_conversion_and_a_step(policy):
    model = _tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pol = mixprec.get_policy(policy, device="cpu", check=False)
    model = pol.prepare(model)
    assert set(pol.fp8_layers) == {"a", "b", "head"}
    assert type(model.a) is not nn.Linear and type(model.head) is not nn.Linear  # converted
    assert model.a.weight is model.b.weight
    assert model.head.weight is model.embed.weight
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    with pol.precision_scope():
        for _ in range(2):
            with pol.autocast():
                loss = nn.functional.cross_entropy(model(tokens).float().reshape(-1, 64), tokens.reshape(-1))
            pol.backward(loss)
            pol.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
    assert model.a.weight is model.b.weight and model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == len(list(_tied().parameters()))


def test_a_map_entry_matching_no_linear_names_the_linear_layers():
    pol = mixprec.get_policy("mxfp8", device="cpu", check=False, keep_bf16=["haed"])
    with pytest.raises(PolicyError, match="'haed'") as info:
        pol.prepare(fresh())
    for name in ("up", "blocks.0", "head"):
        assert name in str(info.value)
    with pytest.raises(PolicyError, match=r"'blocks\.9:wgrad'"):
        convert(fresh(), spec_of("nvfp4"), keep_bf16=["head", "blocks.9:wgrad"])
    with pytest.raises(PolicyError, match="'embed'"):  # an Embedding is no Linear
        convert(_tied(), spec_of("fp8-rowwise"), keep_bf16=["embed"])
    model = fresh()
    convert(model, spec_of("mxfp8"), keep_bf16=["island.0", "tiny"])  # islands, ineligibles: Linears
    assert type(model.up) is BlockLinear


def test_convert_with_a_torchao_kernel_uses_it_where_it_can_express_the_directions():
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    model = fresh()
    weights = {n: p for n, p in model.named_parameters()}
    plan = convert(model, spec_of("mxfp8"), keep_bf16=["blocks.0:wgrad", "blocks.1:dgrad"], kernel="EMULATED")
    assert isinstance(model.up, MXFP8Linear) and not model.up.wgrad_with_hp
    assert isinstance(model.blocks[0], MXFP8Linear) and model.blocks[0].wgrad_with_hp
    assert type(model.blocks[1]) is BlockLinear  # torchao has no switch for dgrad alone
    assert plan.low["blocks.1"] == frozenset({"forward", "wgrad"})
    assert all(p is weights[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("policy", ["mxfp8", "nvfp4"])
def test_a_bare_linear_model_is_converted_or_refused_clearly(policy):
    pol = mixprec.get_policy(policy, device="cpu", check=False)
    try:
        model = pol.prepare(nn.Linear(64, 64))
    except PolicyError:
        return  # a clear refusal is a fix too
    assert type(model) is BlockLinear or pol.fp8_layers == []


def test_fp8_on_a_bare_linear_model_is_refused_not_silently_left_unconverted():
    # torchao returns a new module when the root itself is a Linear; prepare() converts in place
    pol = mixprec.get_policy("fp8-rowwise", device="cpu", check=False)
    with pytest.raises(PolicyError, match="bare Linear"):
        pol.prepare(nn.Linear(64, 64))


# ---------------------------------------------------------------------------- training
def _task() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 32, generator=g) / 32**0.5
    batches = []
    for _ in range(4):
        x = torch.randn(64, 32, generator=g)
        batches.append((x, x @ teacher))
    return model, batches


@pytest.mark.parametrize("policy", ["mxfp8", "nvfp4"])
def test_a_prepared_block_format_model_learns(policy):
    model, batches = _task()
    pol = mixprec.get_policy(policy, device="cpu", check=False)
    model = pol.prepare(model)
    assert pol.fp8_layers == ["0", "2", "4"] and all(type(model[i]) is BlockLinear for i in (0, 2, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with pol.precision_scope():
        for step in range(40):
            x, y = batches[step % len(batches)]
            with pol.autocast():
                out = model(x)
                loss = nn.functional.mse_loss(out.float(), y)
            assert out.dtype == torch.bfloat16  # the rest of the model runs under bf16 autocast
            pol.backward(loss)
            assert pol.step(optimizer) is True
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert pol.stats.skipped_steps == 0
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.5 * first, (first, last)


@pytest.mark.parametrize("policy", ["mxfp8", "nvfp4", "fp8-rowwise"])
def test_a_float64_linear_is_left_in_its_own_dtype(policy):
    """A low format converts fp32 Linears only: a float64 one keeps computing in float64 (converted,
    its output came back in the autocast dtype, silently narrowing a float64 model)."""
    model = nn.Sequential(nn.Linear(64, 64).double(), nn.Linear(64, 64))
    pol = mixprec.get_policy(policy, device="cpu", check=False)
    pol.prepare(model)
    assert type(model[0]) is nn.Linear and "0" in pol.layer_plan.ineligible
    assert "1" in pol.layer_plan.low
    with pol.autocast():
        out = model[0](torch.randn(4, 64, dtype=torch.float64))
    assert out.dtype == torch.float64


@pytest.mark.parametrize("policy", ["fp8-rowwise", "mxfp8", "nvfp4"])
def test_a_parametrized_linear_is_refused_without_running_its_parametrization(policy):
    """A spectral_norm (or weight_norm) Linear computes its weight from a stored one: the formats'
    kernels cannot run that, and reading its weight to learn the dtype ran one more power
    iteration than the script's, moving its u and v (the script's own training)."""
    torch.manual_seed(0)
    normed = nn.utils.parametrizations.spectral_norm(nn.Linear(32, 32))
    model = nn.Sequential(normed, nn.ReLU(), nn.Linear(32, 32))
    norm = model[0].parametrizations.weight[0]
    before = (norm._u.clone(), norm._v.clone())
    plan = plan_layers(model, spec_of(policy))
    assert "0" not in plan.low and "parametrization (spectral_norm, weight_norm)" in plan.refused["0"]
    assert torch.equal(norm._u, before[0]) and torch.equal(norm._v, before[1])
