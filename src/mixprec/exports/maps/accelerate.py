"""The precision map for Accelerate's torchao fp8 backend (1.15 with torchao 0.18, executed in
mixprec's tests): ``AORecipeKwargs(config=..., module_filter_func=...)`` and
``Accelerator(mixed_precision="fp8")``. Named ``accelerate-fp8``: ``accelerate`` is the
training-script target (:mod:`mixprec.exports.accelerate`)."""

from __future__ import annotations

import json
import textwrap

from mixprec.exports.maps.resolve import ResolvedMap
from mixprec.exports.maps.target import MapRefusal, MapTarget, MapText, py_set
from mixprec.policy.blockscale import DIRECTIONS

# The text; @LAYERS@ becomes the FP8_LAYERS set, @RECIPE@ the torchao.float8 recipe name.
_TEXT = textwrap.dedent(
    '''\
    import torch
    from accelerate import Accelerator
    from accelerate.utils import AORecipeKwargs
    from torchao.float8 import Float8LinearConfig

    @LAYERS@

    def module_filter_func(module: torch.nn.Module, fqn: str) -> bool:
        """Exactly the map's layers (Accelerate's default would skip the first and last Linear)."""
        return fqn in FP8_LAYERS


    fp8_kwargs = AORecipeKwargs(
        config=Float8LinearConfig.from_recipe_name(@RECIPE@),
        module_filter_func=module_filter_func,
    )
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[fp8_kwargs])
    model, optimizer = accelerator.prepare(model, optimizer)  # converts FP8_LAYERS to Float8Linear
    '''
)


class AccelerateFp8Map(MapTarget):
    """Accelerate's torchao fp8 conversion, limited to the map's layers."""

    name = "accelerate-fp8"
    title = "Accelerate (torchao fp8)"
    checked = "accelerate 1.15 with torchao 0.18 (executed in mixprec's tests)"

    def cannot_express(self, m: ResolvedMap) -> MapRefusal | None:
        if m.fmt == "fp8":
            return None
        directions = ""
        if m.partial:
            layer, kept = next(iter(m.partial.items()))
            entry = m.entry_for(layer, next(d for d in DIRECTIONS if d in kept))
            directions = (
                f"; and keep_bf16 entry {entry!r} is one GEMM of one layer, while Accelerate's per-GEMM "
                "switch, TERecipeKwargs(override_linear_precision=(fprop, dgrad, wgrad)), applies to every "
                "layer at once (and to Transformer Engine's recipe only)"
            )
        return MapRefusal(
            None,
            f"Accelerate 1.15's torchao backend (AORecipeKwargs) converts Linear layers to torchao's fp8 "
            f"Float8Linear only; it has no {m.fmt} recipe (MXFP8 only through Transformer Engine, "
            f"TERecipeKwargs(use_mxfp8_block_scaling=True), for every layer at once; NVFP4 not at all)"
            f"{directions}",
        )

    def write(self, m: ResolvedMap) -> MapText:
        layers = py_set(
            "FP8_LAYERS", list(m.plan.low), "The Linear layers the map runs in fp8; every other Linear stays."
        )
        recipe = json.dumps(str(m.spec.fp8_recipe))
        return MapText(
            _TEXT.replace("@LAYERS@", layers).replace("@RECIPE@", recipe),
            runs=[
                "Accelerate runs the forward under bf16 autocast for fp8",
                "on a GPU below compute capability 8.9 Accelerate switches mixed_precision='fp8' to fp16 "
                "with only a warning: run on an fp8 GPU",
            ],
            cannot=[
                "single GEMM directions (the fp8 policies have none; TERecipeKwargs' override is global)"
            ],
            fill_in="`model`, `optimizer`",
        )
