"""The precision map for torchtitan's TOML configs (v0.2.x, whose source defines the schema and the
``module_filter_fn``; parsed in mixprec's tests, not run): ``[quantize.linear.float8]`` or
``[quantize.linear.mx]`` with ``filter_fqns``, a substring match that *skips* modules."""

from __future__ import annotations

import json
from collections.abc import Sequence

from mixprec.exports.maps.resolve import ResolvedMap
from mixprec.exports.maps.target import MapRefusal, MapTarget, MapText, refuse_directions

# torch._scaled_mm's divisor, which torchtitan's module_filter_fn applies to every format.
DIVISOR = 16


class TorchtitanMap(MapTarget):
    """torchtitan's Linear converters, configured by TOML."""

    name = "torchtitan"
    title = "torchtitan"
    checked = "torchtitan v0.2.2 source (TOML schema, module_filter_fn); parsed, not run"

    def cannot_express(self, m: ResolvedMap) -> MapRefusal | None:
        if m.fmt == "nvfp4":
            return MapRefusal(
                None,
                "no torchtitan release configured by TOML has an NVFP4 converter (v0.2.2, the last, has "
                "quantize.linear.float8 and quantize.linear.mx only); the NVFP4 converter torchtitan added "
                "after moving to Python configs selects the layers to convert by substring ('fqns', every "
                "Linear when empty) and cannot switch single GEMMs (its nvfp4.md)",
            )
        refused = refuse_directions(
            m, "torchtitan converts a Linear whole, with one recipe for the model (filter_fqns names modules)"
        )
        if refused is not None:
            return refused
        for skipped in filter_fqns(m):
            for converted in m.plan.low:
                if skipped in converted:
                    return MapRefusal(
                        skipped,
                        f"torchtitan's filter_fqns skips every Linear whose FQN contains an entry, and the "
                        f"kept layer {skipped!r} is a substring of the converted layer {converted!r}, which "
                        "torchtitan would skip too",
                        "rename one of the modules",
                    )
        return None

    def write(self, m: ResolvedMap) -> MapText:
        section, recipe = (
            ("float8", str(m.spec.fp8_recipe)) if m.fmt == "fp8" else ("mx", "mxfp8_cublas_rceil")
        )
        skipped = filter_fqns(m)
        why = {n: "kept by the map" for n in m.plan.kept}
        why.update({n: "shape outside the format" for n in m.plan.ineligible})
        why.update({n: "fp32 island" for n in m.islands})
        body = (
            "[model]  # merge `converters` into your [model] table\n"
            f'converters = ["quantize.linear.{section}"]\n\n'
            f"[quantize.linear.{section}]\n"
            f"recipe_name = {json.dumps(recipe)}\n"
            "# SKIPPED: every Linear whose FQN *contains* one of these strings (substring match, not exact)\n"
            f"filter_fqns = {_toml_list(skipped, {n: why[n] for n in skipped})}\n"
        )
        runs = [
            "filter_fqns lists every Linear the map keeps out of the format whose dimensions are multiples "
            "of 16 (torchtitan skips the others itself); it replaces torchtitan's default",
        ]
        if m.fmt == "mxfp8":
            runs.append(
                "recipe mxfp8_cublas_rceil: RCEIL scales as mixprec's MXFP8 (plain mxfp8_cublas rounds its "
                "scales down, FLOOR); torchtitan v0.2.x builds it with torchao's MXLinearConfig, which "
                "torchao 0.17 removed: use torchao <= 0.16; needs a Blackwell GPU"
            )
        else:
            runs.append("needs an fp8 GPU (compute capability >= 8.9), or float8.emulate = true to test")
        return MapText(
            body,
            runs,
            cannot=[
                "single GEMM directions (refused); exact names: filter_fqns is a substring match (a kept FQN "
                "inside a converted one is refused)",
            ],
            fill_in="your torchtitan v0.2.x job config (configured by TOML; later releases take Python "
            "configs): merge these tables into it; the FQNs are those of your torchtitan model, which must "
            "be the model this map was resolved on",
        )


def filter_fqns(m: ResolvedMap) -> list[str]:
    """The Linear layers torchtitan would convert (dimensions multiples of 16) but the map keeps out
    of the format (kept, ineligible, fp32 islands): its filter_fqns."""
    return [n for n in m.left() if all(d % DIVISOR == 0 for d in m.shapes[n])]


def _toml_list(names: Sequence[str], comments: dict[str, str]) -> str:
    rows = "".join(f"    {json.dumps(n)},{'  # ' + comments[n] if n in comments else ''}\n" for n in names)
    return f"[\n{rows}]" if names else "[]"
