"""Precision maps written for other stacks (the precision-map targets, mixprec.exports.maps, through
mixprec.export and its shorthand mixprec.exports.precision_map.render), checked with the real
libraries where they are installed (torchao 0.18, accelerate 1.15): the rendered code is executed on
a model and must convert exactly the layers mixprec converts; MXFP8Linear, emulated, must compute
what mixprec's MXFP8 emulation computes. torchtitan (TOML), Megatron-LM (YAML) and Transformer
Engine (Python) are not installed: their texts are parsed and checked against the schema their
sources define, and every refusal is asserted to name the entry or format and an alternative."""

from __future__ import annotations

import ast
import copy
import fnmatch
import re
import tomllib

import pytest
import torch
import yaml
from torch import nn

import mixprec
from extras import require
from mixprec import Candidate
from mixprec.errors import ExportRefused, PolicyError, UsageError
from mixprec.exports.precision_map import MAP_TARGETS, render

require("torchao", "fp8")  # fails, not skips, under make test (MIXPREC_REQUIRE_FRAMEWORKS=1)

from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear  # noqa: E402
from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402


def mlp(*dims: int, names: tuple[str, ...] = ("fc1", "fc2", "head")) -> nn.Sequential:
    """Linear layers ``dims[i] -> dims[i+1]`` named ``names``, a GELU between each two."""
    torch.manual_seed(0)
    model = nn.Sequential()
    for i, name in enumerate(names):
        if i:
            model.add_module(f"act{i}", nn.GELU())
        model.add_module(name, nn.Linear(dims[i], dims[i + 1]))
    return model


def small() -> nn.Sequential:
    return mlp(64, 128, 128, 32)


def wide() -> nn.Sequential:
    """Every dimension a multiple of 128: what torchao's NVFP4 GEMM takes."""
    return mlp(128, 256, 256, 128)


def run(text: str, **names: object) -> dict[str, object]:
    namespace: dict[str, object] = dict(names)
    exec(compile(text, "<precision map>", "exec"), namespace)
    return namespace


def refusal(policy: str, model: nn.Module, keep: list[str], target: str) -> ExportRefused:
    """The refusal, through the one entry of every target (render is its shorthand)."""
    with pytest.raises(ExportRefused) as info:
        mixprec.export(Candidate(policy, keep_bf16=tuple(keep)), target, device="cuda", model=model)
    with pytest.raises(ExportRefused, match=re.escape(info.value.reason)):
        render(policy, model, keep, target)
    return info.value


# ---------------------------------------------------------------------------------------- torchao
@pytest.mark.parametrize("policy", ["fp8-rowwise", "fp8-tensorwise"])
def test_torchao_fp8_converts_exactly_the_layers_mixprec_converts(policy):
    model = small()
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    ours = mixprec.get_policy(Candidate(policy, keep_bf16=("head",)), device="cpu", check=False).prepare(
        copy.deepcopy(model)
    )
    model = run(render(policy, model, ["head"], "torchao"), model=model)["model"]
    assert isinstance(model, nn.Sequential)
    assert type(model.fc1) is Float8Linear and type(model.fc2) is Float8Linear
    assert type(model.head) is nn.Linear
    assert model.fc1.config == Float8LinearConfig.from_recipe_name(policy.removeprefix("fp8-"))
    # the same Parameter objects: an optimizer built before the conversion still steps them
    assert all(model.get_submodule(n).weight is w for n, w in weights.items())
    assert {n: type(m) for n, m in model.named_modules()} == {n: type(m) for n, m in ours.named_modules()}


def test_a_glob_is_written_as_the_exact_layer_names():
    text = render("fp8-rowwise", small(), ["f?2", "head"], "torchao")
    assert ast.literal_eval(assigned(ast.parse(text), "FP8_LAYERS").args[0]) == ["fc1"]
    assert '["f?2", "head"]' in text  # the header quotes the map as given
    model = run(text, model=small())["model"]
    assert [type(model.get_submodule(n)) for n in ("fc1", "fc2", "head")] == [
        Float8Linear,
        nn.Linear,
        nn.Linear,
    ]


def test_torchao_mxfp8_swaps_the_map_and_emulated_matches_mixprec_bit_for_bit():
    """MXFP8Linear (EMULATED kernels) against mixprec's BlockLinear, both in fp32 without autocast:
    fc1 (all three GEMMs in MXFP8) matches in its forward and both gradients; fc2 (':wgrad' kept:
    wgrad_with_hp) in its forward and the gradient it sends back (its own weight gradient differs:
    torchao multiplies the fp32 operands, mixprec rounds them to bf16); head stays a Linear."""
    keep = ["head", "fc2:wgrad"]
    model = small()
    reference = mixprec.get_policy(Candidate("mxfp8", keep_bf16=tuple(keep)), device="cpu", check=False)
    reference_model = reference.prepare(copy.deepcopy(model))
    text = render("mxfp8", model, keep, "torchao")
    model = run(text, model=model)["model"]
    assert type(model.fc1) is MXFP8Linear and type(model.fc2) is MXFP8Linear and type(model.head) is nn.Linear
    assert (model.fc1.wgrad_with_hp, model.fc2.wgrad_with_hp) == (False, True)
    for layer in (model.fc1, model.fc2):
        assert layer.kernel_preference is KernelPreference.AUTO
        assert layer.scale_calculation_mode is ScaleCalculationMode.RCEIL
        layer.kernel_preference = KernelPreference.EMULATED

    torch.manual_seed(1)
    x = torch.randn(64, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = model(xa), reference_model(xb)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(xa.grad, xb.grad)  # through fc2's and fc1's MXFP8 dgrad
    for name in ("fc1.weight", "fc1.bias", "fc2.bias", "head.weight", "head.bias"):
        assert torch.equal(model.get_parameter(name).grad, reference_model.get_parameter(name).grad), name
    hidden = torch.randn(64, 128)
    assert torch.equal(model.fc2(hidden), reference_model.fc2(hidden))


@pytest.mark.parametrize("entry", ["fc2:forward", "fc2:dgrad"])
def test_torchao_mxfp8_refuses_a_kept_forward_or_dgrad(entry):
    refused = refusal("mxfp8", small(), [entry], "torchao")
    assert refused.entry == entry and refused.policy == "mxfp8"
    assert "MXFP8Linear" in refused.reason and "wgrad_with_hp" in refused.reason
    assert "entry 'fc2'" in refused.alternative and "mixprec" in refused.alternative


def test_torchao_nvfp4_converts_the_map_on_the_cpu():
    """NVFP4TrainingConfig and quantize_ convert on a CPU (running the layers needs Triton and a
    Blackwell GPU; here the conversion is what is checked)."""
    model = wide()
    weights = {n: model.get_submodule(n).weight for n in ("fc1", "fc2", "head")}
    model = run(render("nvfp4", model, ["head"], "torchao"), model=model)["model"]
    assert type(model.fc1) is NVFP4Linear and type(model.fc2) is NVFP4Linear and type(model.head) is nn.Linear
    assert all(model.get_submodule(n).weight is w for n, w in weights.items())


def test_torchao_nvfp4_refuses_directions_and_shapes_its_gemm_cannot_take():
    refused = refusal("nvfp4", wide(), ["fc2:wgrad"], "torchao")
    assert refused.entry == "fc2:wgrad" and "NVFP4Linear" in refused.reason
    refused = refusal("nvfp4", small(), ["head"], "torchao")
    assert refused.entry == "fc1" and "64 -> 128" in refused.reason and "128" in refused.reason
    assert "add 'fc1' to keep_bf16" in refused.alternative
    assert "megatron" in refused.alternative and "transformer-engine" in refused.alternative


# ------------------------------------------------------------------------------------- torchtitan
def titan_converts(model: nn.Module, filter_fqns: list[str]) -> list[str]:
    """torchtitan v0.2.2's module_filter_fn (torchtitan/components/quantization/utils.py), applied as
    its converters apply it: a Linear with both dimensions multiples of 16 whose FQN contains no
    filter_fqns entry is converted."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and m.weight.shape[0] % 16 == 0
        and m.weight.shape[1] % 16 == 0
        and not any(f in n for f in filter_fqns)
    ]


@pytest.mark.parametrize(
    ("policy", "section", "recipe"),
    [
        ("fp8-rowwise", "float8", "rowwise"),
        ("fp8-tensorwise", "float8", "tensorwise"),
        ("mxfp8", "mx", "mxfp8_cublas_rceil"),
    ],
)
def test_torchtitan_toml_skips_exactly_the_kept_layers(policy, section, recipe):
    # 48 is a multiple of 16, not of MXFP8's 32: torchtitan would convert fc1 and mid under mx
    model = mlp(64, 48, 128, 128, 128, 32, names=("fc1", "mid", "fc2", "attn", "head"))
    text = render(policy, model, ["head", "at*"], "torchtitan")
    config = tomllib.loads(text)
    assert config["model"]["converters"] == [f"quantize.linear.{section}"]
    linear = config["quantize"]["linear"][section]
    assert linear["recipe_name"] == recipe
    kept = ["attn", "head"] if section == "float8" else ["fc1", "mid", "attn", "head"]
    assert linear["filter_fqns"] == kept
    converted = ["fc1", "mid", "fc2"] if section == "float8" else ["fc2"]
    assert titan_converts(model, linear["filter_fqns"]) == converted
    assert "substring" in text


def test_torchtitan_refuses_a_kept_name_inside_a_converted_one():
    model = mlp(64, 128, 128, 32, names=("proj", "proj2", "head"))
    refused = refusal("fp8-rowwise", model, ["proj"], "torchtitan")
    assert refused.entry == "proj" and "'proj2'" in refused.reason and "substring" in refused.reason
    assert "torchao" in refused.alternative and "accelerate-fp8" in refused.alternative
    assert titan_converts(model, ["proj"]) == ["head"]  # what torchtitan would have done


def test_torchtitan_refuses_directions_and_nvfp4():
    refused = refusal("mxfp8", small(), ["fc2:wgrad"], "torchtitan")
    assert refused.entry == "fc2:wgrad" and "converts a Linear whole" in refused.reason
    assert "the torchao target can express this map" in refused.alternative
    refused = refusal("nvfp4", wide(), ["head"], "torchtitan")
    assert refused.entry is None and "NVFP4" in refused.reason and "TOML" in refused.reason
    assert "torchao" in refused.alternative and "megatron" in refused.alternative


# ------------------------------------------------------------------------------------- accelerate
@pytest.mark.frameworks
def test_accelerate_converts_exactly_the_map_through_ao_recipe_kwargs():
    require("accelerate", "frameworks")
    from accelerate.state import AcceleratorState
    from accelerate.utils import AORecipeKwargs

    model = small()
    text = render("fp8-rowwise", model, ["head"], "accelerate-fp8")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        namespace = run(text, model=model, optimizer=optimizer)
        kwargs = namespace["fp8_kwargs"]
        assert isinstance(kwargs, AORecipeKwargs)
        assert kwargs.config == Float8LinearConfig.from_recipe_name("rowwise")
        accepts = kwargs.module_filter_func
        assert accepts(model.fc1, "fc1") and accepts(model.fc2, "fc2") and not accepts(model.head, "head")
        assert namespace["accelerator"].mixed_precision == "fp8"
        prepared = namespace["model"]
        assert [type(prepared.get_submodule(n)) for n in ("fc1", "fc2", "head")] == [
            Float8Linear,
            Float8Linear,
            nn.Linear,
        ]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize(("policy", "model"), [("mxfp8", small), ("nvfp4", wide)])
def test_accelerate_refuses_the_block_formats(policy, model):
    refused = refusal(policy, model(), ["head"], "accelerate-fp8")
    assert refused.entry is None and refused.policy == policy
    assert "AORecipeKwargs" in refused.reason and "Float8Linear only" in refused.reason
    assert "torchao" in refused.alternative
    with_direction = refusal(policy, model(), ["fc2:wgrad"], "accelerate-fp8")
    assert "'fc2:wgrad'" in with_direction.reason and "override_linear_precision" in with_direction.reason


# --------------------------------------------------------------------------------------- megatron
# TEQuantizationRecipe's fields (megatron/core/extensions/transformer_engine.py): parse_from_config
# raises on any other key.
MEGATRON_RECIPE_KEYS = {
    "fp8_quantization_recipe",
    "fp4_quantization_recipe",
    "custom_recipe_factory",
    "fp8_format",
    "override_quantized_autocast",
    "override_nonquantized_autocast",
    "tp_only_amax_red",
    "fp8_param",
    "fp4_param",
}


def megatron_config_of(recipe: dict, module_path: str) -> str | None:
    """Megatron's RecipeConfig.match_to_config_key: the first enabled glob matcher wins."""
    for matcher in recipe["matchers"].values():
        if matcher.get("enabled", False) and fnmatch.fnmatch(module_path, matcher["pattern"]):
            return matcher["config"]
    return None


@pytest.mark.parametrize(
    ("policy", "model", "expected"),
    [
        ("fp8-tensorwise", small, {"fp8_quantization_recipe": "tensorwise", "fp8_format": "hybrid"}),
        ("mxfp8", small, {"fp8_quantization_recipe": "mxfp8", "fp8_format": "e4m3"}),
        ("nvfp4", wide, {"fp4_quantization_recipe": "nvfp4"}),
    ],
)
def test_megatron_yaml_follows_the_te_precision_config_schema(policy, model, expected):
    net = model()
    text = render(policy, net, ["head"], "megatron")
    recipe = yaml.safe_load(text)
    assert set(recipe) == {"configs", "matchers"}
    for config in recipe["configs"].values():
        assert config["transformer_engine_config_type"] == "TEQuantizationParams"
        assert set(config) == {"transformer_engine_config_type", "training_recipe"}
        assert set(config["training_recipe"]) <= MEGATRON_RECIPE_KEYS
    fmt = policy.split("-")[0]
    assert recipe["configs"]["bf16"]["training_recipe"] == {}
    assert recipe["configs"][fmt]["training_recipe"] == {**expected, "override_nonquantized_autocast": True}
    for matcher in recipe["matchers"].values():
        assert (
            matcher["type"] == "glob"
            and matcher["enabled"] is True
            and matcher["config"] in recipe["configs"]
        )
    assert {n: megatron_config_of(recipe, n) for n in ("fc1", "fc2", "head")} == {
        "fc1": fmt,
        "fc2": fmt,
        "head": "bf16",
    }
    assert "--te-precision-config-file" in text and "never run" in text


def test_megatron_patterns_match_only_their_own_module():
    model = mlp(64, 128, 128, 32, names=("fc1", "fc[1]", "head"))
    recipe = yaml.safe_load(render("mxfp8", model, ["head", "fc[[]1]"], "megatron"))
    assert {n: megatron_config_of(recipe, n) for n in ("fc1", "fc[1]", "head")} == {
        "fc1": "mxfp8",
        "fc[1]": "bf16",
        "head": "bf16",
    }


def test_megatron_refuses_directions_and_rowwise():
    refused = refusal("mxfp8", small(), ["fc2:wgrad"], "megatron")
    assert refused.entry == "fc2:wgrad" and "one recipe per module" in refused.reason
    assert "torchao" in refused.alternative
    refused = refusal("fp8-rowwise", small(), ["head"], "megatron")
    assert refused.entry is None and "rowwise" in refused.reason and "fp8-tensorwise" in refused.alternative


# ----------------------------------------------------------------------------- transformer-engine
def assigned(tree: ast.Module, name: str) -> ast.expr:
    return next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    )


@pytest.mark.parametrize(
    ("policy", "model", "recipe"),
    [
        ("fp8-tensorwise", small, "Float8CurrentScaling(fp8_format=Format.HYBRID)"),
        ("mxfp8", small, "MXFP8BlockScaling()"),
        ("nvfp4", wide, "NVFP4BlockScaling()"),
    ],
)
def test_transformer_engine_text_parses_and_names_the_recipe_and_layers(policy, model, recipe):
    text = render(policy, model(), ["head"], "transformer-engine")
    tree = ast.parse(text)
    assert ast.unparse(assigned(tree, "recipe")) == recipe
    layers = assigned(tree, "TE_LAYERS")
    assert isinstance(layers, ast.Call) and ast.literal_eval(layers.args[0]) == ["fc1", "fc2"]
    assert "#   head\n" in text and "te.autocast(recipe=recipe)" in text
    assert "checked by parsing only" in text


def test_transformer_engine_refuses_directions_and_rowwise():
    refused = refusal("nvfp4", wide(), ["fc1:wgrad"], "transformer-engine")
    assert refused.entry == "fc1:wgrad" and "Transformer Engine" in refused.reason
    assert "entry 'fc1'" in refused.alternative and "mixprec" in refused.alternative
    refused = refusal("fp8-rowwise", small(), ["head"], "transformer-engine")
    assert refused.entry is None and "torchao" in refused.alternative


# ----------------------------------------------------------------------------- header and errors
def header_text(text: str) -> str:
    """The header's comment lines joined into one line, the ``#`` and the bullets' indents dropped."""
    header = text.split("\n\n")[0].splitlines()
    assert all(line.startswith("#") for line in header)
    return " ".join(line.removeprefix("#").strip() for line in header)


@pytest.mark.parametrize("target", MAP_TARGETS)
def test_every_text_opens_with_the_export_header(target):
    policy = (
        "fp8-tensorwise" if target in ("accelerate-fp8", "megatron", "transformer-engine") else "fp8-rowwise"
    )
    text = render(policy, small(), ["head"], target)
    assert text.startswith(f"# mixprec export: policy '{policy}' on cuda (keep_bf16=[\"head\"]) -> ")
    flat = header_text(text)
    for part in (
        "What runs: - " + policy,
        "the map resolved against the model's Linear layers",
        "- share: 2 of 3 Linear layers",
        "Notes (what ",
        "You fill in: ",
    ):
        assert part in flat, part


def test_the_share_counts_layers_gemms_and_work():
    flat = header_text(render("mxfp8", small(), ["head", "fc2:wgrad"], "torchao"))
    assert "2 of 3 Linear layers run in mxfp8; 5 of 9 Linear GEMMs, 66.7% of the Linear GEMM work" in flat
    assert "in mxfp8: fc1, fc2 (all but wgrad)" in flat and "kept in bf16 by the map: head" in flat


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(UsageError, match=r"Unknown export target 'torchtitian'.*'torchtitan'"):
        render("mxfp8", small(), [], "torchtitian")
    with pytest.raises(UsageError, match=r"not a precision-map target.*Did you mean 'accelerate-fp8'"):
        render("fp8-rowwise", small(), [], "accelerate")  # the training script, not the map
    with pytest.raises(PolicyError, match="'bf16-mixed' runs no Linear in a low format"):
        render("bf16-mixed", small(), [], "torchao")
    with pytest.raises(PolicyError, match="'lm_head' matches no Linear"):
        render("mxfp8", small(), ["lm_head"], "torchao")
    with pytest.raises(PolicyError, match="converts a Linear whole"):
        render("fp8-rowwise", small(), ["fc2:wgrad"], "torchao")
    refused = refusal("fp8-rowwise", small(), ["head"], "megatron")
    assert isinstance(refused, ExportRefused) and isinstance(refused, UsageError) and refused.exit_code == 2
    assert str(refused).startswith("Cannot export policy 'fp8-rowwise' on cuda to Megatron-LM: ")


def test_fp32_islands_stay_out_of_the_format():
    model = small()
    text = render("fp8-rowwise", model, [], "torchtitan", keep_fp32=("head",))
    assert tomllib.loads(text)["quantize"]["linear"]["float8"]["filter_fqns"] == ["head"]
    assert '"head",  # fp32 island' in text and "fp32 islands (keep_fp32): head" in header_text(text)
    converted = run(render("fp8-rowwise", model, [], "torchao", keep_fp32=("head",)), model=model)["model"]
    assert [type(converted.get_submodule(n)) for n in ("fc1", "fc2", "head")] == [
        Float8Linear,
        Float8Linear,
        nn.Linear,
    ]
