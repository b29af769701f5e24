"""The precision map for Megatron-LM (written from its source: megatron/core/quantization/quant_config.py
and TEQuantizationParams, 2026-08; parsed and schema-checked in mixprec's tests, not installed): YAML
for ``--te-precision-config-file``, a ``bf16`` and a format config and one glob matcher per Linear."""

from __future__ import annotations

import json
import re

from mixprec.exports.maps.resolve import ResolvedMap
from mixprec.exports.maps.target import MapRefusal, MapTarget, MapText
from mixprec.exports.maps.transformer_engine import te_recipe_refusal


class MegatronMap(MapTarget):
    """Megatron-LM's per-module precision config (its Transformer Engine layers)."""

    name = "megatron"
    title = "Megatron-LM"
    aliases = ("megatron-lm",)
    checked = "Megatron-LM source, 2026-08 (read, not run)"

    def cannot_express(self, m: ResolvedMap) -> MapRefusal | None:
        return te_recipe_refusal(m, "Megatron-LM (through Transformer Engine)")

    def write(self, m: ResolvedMap) -> MapText:
        recipe, flags = _recipe(m.fmt)
        matchers: dict[str, object] = {}
        for i, name in enumerate(m.left()):
            matchers[f"bf16_{i}"] = _matcher("bf16", name)
        for i, name in enumerate(m.plan.low):
            matchers[f"{m.fmt}_{i}"] = _matcher(m.fmt, name)
        tea = "TEQuantizationParams"
        data = {
            "configs": {
                "bf16": {"transformer_engine_config_type": tea, "training_recipe": {}},
                m.fmt: {"transformer_engine_config_type": tea, "training_recipe": recipe},
            },
            "matchers": matchers,
        }
        cannot = ["single GEMM directions (refused)"]
        if m.fmt == "fp8":
            cannot.append("fp8-rowwise (refused): Megatron's fp8 recipes have no per-row scaling")
        return MapText(
            _yaml_block(data),
            runs=[
                "the patterns are your Megatron model's module paths (matched with fnmatch, first matcher "
                "wins); modules that are no Transformer Engine layer are never quantized",
                "written from Megatron-LM's source (megatron/core/quantization/quant_config.py, "
                "TEQuantizationParams in megatron/core/extensions/transformer_engine.py, 2026-08); "
                "Megatron-LM is not installed here: checked by parsing and schema only, never run",
            ],
            cannot=cannot,
            fill_in="your Megatron model, whose module paths must be the names this map was resolved on",
            launch=f"pretrain_gpt.py ... {flags} --te-precision-config-file precision_map.yaml",
        )


def _recipe(fmt: str) -> tuple[dict[str, object], str]:
    """The format's TEQuantizationRecipe fields and the command-line flags that select it."""
    recipe: dict[str, object]
    if fmt == "nvfp4":
        recipe, flags = {"fp4_quantization_recipe": "nvfp4"}, "--fp4-format e2m1 --fp4-recipe nvfp4"
    elif fmt == "mxfp8":
        recipe = {"fp8_quantization_recipe": "mxfp8", "fp8_format": "e4m3"}
        flags = "--fp8-format e4m3 --fp8-recipe mxfp8"
    else:
        recipe = {"fp8_quantization_recipe": "tensorwise", "fp8_format": "hybrid"}
        flags = "--fp8-format hybrid --fp8-recipe tensorwise"
    recipe["override_nonquantized_autocast"] = True
    return recipe, flags


def _matcher(config: str, name: str) -> dict[str, object]:
    return {"config": config, "type": "glob", "pattern": _glob_literal(name), "enabled": True}


def _glob_literal(name: str) -> str:
    """``name`` as an fnmatch pattern that matches only itself."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _yaml_block(data: dict[str, object], indent: int = 0) -> str:
    """Block YAML of nested dicts with str/bool leaves (strings JSON-quoted, valid YAML)."""
    out = []
    pad = "  " * indent
    for key, value in data.items():
        if isinstance(value, dict):
            if value:
                out.append(f"{pad}{key}:\n{_yaml_block(value, indent + 1)}")
            else:
                out.append(f"{pad}{key}: {{}}\n")
        else:
            out.append(f"{pad}{key}: {json.dumps(value)}\n")
    return "".join(out)
