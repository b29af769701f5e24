"""The precision map for Transformer Engine (written from its source, transformer_engine/common/recipe
and te.autocast, v2.18 era; parsed in mixprec's tests, TE is not installed): the map's layers as
``te.Linear`` under one TE recipe, the kept ones left ``torch.nn.Linear``. Also the recipe rules
Megatron-LM shares, as it quantizes through TE."""

from __future__ import annotations

from mixprec.exports.maps.resolve import ResolvedMap
from mixprec.exports.maps.target import MapRefusal, MapTarget, MapText, py_set, refuse_directions

_TE_FP8_RECIPES = (
    "Float8CurrentScaling (per tensor), Float8BlockScaling (1x128/128x128 blocks), MXFP8BlockScaling"
)

_TO_TE = '''

def to_te(linear: torch.nn.Linear) -> te.Linear:
    """A te.Linear holding a copy of `linear`'s parameters (build the optimizer after this)."""
    new = te.Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        params_dtype=linear.weight.dtype,
        device=linear.weight.device,
    )
    with torch.no_grad():
        new.weight.copy_(linear.weight)
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    return new


for name in TE_LAYERS:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, child, to_te(getattr(parent, child)))

# each step (TE < 2.9: te.fp8_autocast(enabled=True, fp8_recipe=recipe)):
#   with torch.autocast("cuda", dtype=torch.bfloat16), te.autocast(recipe=recipe):
#       loss = loss_fn(model(batch), target)
'''


def te_recipe_refusal(m: ResolvedMap, stack: str) -> MapRefusal | None:
    """Where a stack that quantizes with TE's recipes (TE itself, Megatron-LM) cannot express a map:
    rowwise fp8, and single GEMM directions."""
    if m.spec.fp8_recipe == "rowwise":
        return MapRefusal(
            None,
            f"torchao's rowwise fp8 recipe (one power-of-two scale per row, e4m3 gradients) has no "
            f"counterpart in {stack}'s recipes ({_TE_FP8_RECIPES}, delayed scaling)",
            "use fp8-tensorwise (Float8CurrentScaling)",
        )
    return refuse_directions(
        m,
        f"{stack} picks one recipe per module (its backward_override keeps dgrad and wgrad together, for "
        "every module under the recipe)",
    )


class TransformerEngineMap(MapTarget):
    """Transformer Engine's Linear under one recipe for the map's layers."""

    name = "transformer-engine"
    title = "Transformer Engine"
    aliases = ("te", "transformer_engine")
    checked = "Transformer Engine source, 2026-08 (read, not run)"

    def cannot_express(self, m: ResolvedMap) -> MapRefusal | None:
        return te_recipe_refusal(m, "Transformer Engine")

    def write(self, m: ResolvedMap) -> MapText:
        if m.fmt == "nvfp4":
            recipe_class, recipe_call = "NVFP4BlockScaling", "NVFP4BlockScaling()"
        elif m.fmt == "mxfp8":
            recipe_class, recipe_call = "MXFP8BlockScaling", "MXFP8BlockScaling()  # e4m3 everywhere"
        else:
            recipe_class = "Float8CurrentScaling, Format"
            recipe_call = "Float8CurrentScaling(fp8_format=Format.HYBRID)  # e4m3 forward, e5m2 gradients"
        body = (
            "import torch\n"
            "import transformer_engine.pytorch as te\n"
            f"from transformer_engine.common.recipe import {recipe_class}\n\n"
            f"recipe = {recipe_call}\n\n"
            "# TE quantizes only its own modules inside te.autocast: the map's layers become te.Linear; the\n"
            "# layers it keeps in bf16 stay torch.nn.Linear (left out of the recipe):\n"
            + "".join(f"#   {n}\n" for n in m.left())
            + py_set("TE_LAYERS", list(m.plan.low), f"The Linear layers the map runs in {m.fmt}.")
            + _TO_TE
        )
        cannot = [
            "single GEMM directions (refused): TE has one recipe per autocast region; only its experimental "
            "CustomRecipe (quantizer factories per module name and tensor role) could express them"
        ]
        if m.fmt == "fp8":
            cannot.append("fp8-rowwise (refused): TE has no per-row fp8 recipe")
        return MapText(
            body,
            runs=[
                "written from Transformer Engine's source (transformer_engine/common/recipe/__init__.py, "
                "te.autocast in transformer_engine/pytorch/quantization.py, v2.18 era); TE is not installed "
                "here: checked by parsing only, never run",
            ],
            cannot=cannot,
            fill_in="`model` (on the GPU), then the optimizer, `loss_fn`, `batch`",
        )
