"""The precision map for torchao (0.18, executed in mixprec's tests): fp8 through
``convert_to_float8_training``, mxfp8 as ``MXFP8Linear`` swaps, nvfp4 through ``quantize_``."""

from __future__ import annotations

import json
import textwrap

from mixprec.exports.maps.resolve import GEMM, ResolvedMap
from mixprec.exports.maps.target import (
    MapRefusal,
    MapTarget,
    MapText,
    py_set,
    refuse_directions,
    whole_layer_hint,
)

# torchao's NVFP4 Triton GEMM (nvfp4_mm_triton) needs M, K and N all multiples of 128.
NVFP4_DIVISOR = 128

# The mxfp8 text; @LAYERS@ becomes the dict's rows.
_MXFP8_TEXT = textwrap.dedent(
    '''\
    import torch
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    # The Linear layers the map runs in MXFP8 -> wgrad_with_hp (True: the weight-gradient GEMM
    # stays in high precision, a ':wgrad' entry). Every other Linear stays torch.nn.Linear.
    MXFP8_LAYERS = {
    @LAYERS@}


    def to_mxfp8(linear: torch.nn.Linear, wgrad_with_hp: bool) -> MXFP8Linear:
        """torchao's MXFP8 training Linear on `linear`'s own parameters (optimizer, ties unchanged)."""
        new = MXFP8Linear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            kernel_preference=KernelPreference.AUTO,
            scale_calculation_mode=ScaleCalculationMode.RCEIL,
            wgrad_with_hp=wgrad_with_hp,
        )
        new.weight, new.bias = linear.weight, linear.bias
        return new


    for name, wgrad_with_hp in MXFP8_LAYERS.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if type(linear) is not torch.nn.Linear:
            raise TypeError(f"{name} is a {type(linear).__name__}, not the torch.nn.Linear of the map")
        setattr(parent, child, to_mxfp8(linear, wgrad_with_hp))
    '''
)

_OTHERS = "every other Linear stays."
AUTOCAST_NOTE = (
    "train as the policy does: fp32 weights, the forward under torch.autocast('cuda', "
    "dtype=torch.bfloat16), so every Linear outside the format runs in bf16"
)


class TorchaoMap(MapTarget):
    """torchao's training conversions, one per format, limited to the map's layers."""

    name = "torchao"
    title = "torchao"
    checked = "torchao 0.18 (executed in mixprec's tests)"

    def cannot_express(self, m: ResolvedMap) -> MapRefusal | None:
        if m.fmt == "mxfp8":
            found = m.first_partial(lambda kept: kept == {"wgrad"})
            if found is not None:
                entry, layer, _ = found
                kept = sorted(m.partial[layer])
                return MapRefusal(
                    entry,
                    f"keep_bf16 entry {entry!r} keeps {layer}'s {', '.join(GEMM[d] for d in kept)} in bf16; "
                    "torchao's MXFP8Linear always runs the forward and dgrad GEMMs in MXFP8 and can keep "
                    "only the weight-gradient GEMM in high precision (wgrad_with_hp)",
                    whole_layer_hint(layer),
                )
        if m.fmt == "nvfp4":
            return _nvfp4_refusal(m)
        return None

    def write(self, m: ResolvedMap) -> MapText:
        if m.fmt == "fp8":
            return _fp8(m)
        if m.fmt == "mxfp8":
            return _mxfp8(m)
        return _nvfp4(m)


def _nvfp4_refusal(m: ResolvedMap) -> MapRefusal | None:
    refused = refuse_directions(
        m,
        "torchao's NVFP4Linear runs all three GEMMs in NVFP4 (NVFP4TrainingConfig has no per-GEMM option)",
    )
    if refused is not None:
        return refused
    for layer in m.plan.low:
        k, n = m.shapes[layer]
        if k % NVFP4_DIVISOR or n % NVFP4_DIVISOR:
            return MapRefusal(
                layer,
                f"Linear {layer} ({k} -> {n}) runs in NVFP4 under mixprec's map, but torchao's NVFP4 "
                f"GEMM (nvfp4_mm_triton) needs every dimension a multiple of {NVFP4_DIVISOR}",
                f"keep it in bf16 (add {layer!r} to keep_bf16)",
            )
    return None


def _fp8(m: ResolvedMap) -> MapText:
    body = (
        "from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n\n"
        + py_set(
            "FP8_LAYERS", list(m.plan.low), "The Linear layers the map runs in fp8; every other Linear stays."
        )
        + f"\nconfig = Float8LinearConfig.from_recipe_name({json.dumps(str(m.spec.fp8_recipe))})\n"
        "model = convert_to_float8_training(\n"
        "    model, config=config, module_filter_fn=lambda module, fqn: fqn in FP8_LAYERS\n"
        ")\n"
    )
    return MapText(
        body,
        runs=[
            "torch._scaled_mm needs both dimensions of a layer multiples of 16 (mixprec leaves the others "
            "out of the map already) and an fp8 GPU (compute capability >= 8.9)"
        ],
        cannot=["single GEMM directions (Float8Linear takes one recipe per layer; mixprec refuses them too)"],
        fill_in="`model` (built, on its device, before the optimizer); " + AUTOCAST_NOTE,
    )


def _mxfp8(m: ResolvedMap) -> MapText:
    rows = []
    for name, low in m.plan.low.items():
        hp = "wgrad" not in low
        comment = f"  # keep_bf16 {m.entry_for(name, 'wgrad')!r}" if hp else ""
        rows.append(f"    {json.dumps(name)}: {hp},{comment}\n")
    return MapText(
        _MXFP8_TEXT.replace("@LAYERS@", "".join(rows)),
        runs=[
            "kernel_preference AUTO needs a Blackwell GPU (sm100); KernelPreference.EMULATED runs "
            "anywhere and matches mixprec's MXFP8 emulation bit for bit"
        ],
        cannot=[
            "a kept forward or dgrad GEMM (MXFP8Linear always runs both in MXFP8; refused)",
            "a ':wgrad' entry exactly: torchao's high-precision wgrad multiplies the operands in their own "
            "dtype (fp32 where the layer's input is fp32), where mixprec rounds both to bf16",
        ],
        fill_in="`model` (built, on its device); " + AUTOCAST_NOTE,
    )


def _nvfp4(m: ResolvedMap) -> MapText:
    body = (
        "import torch\n"
        "from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig\n"
        "from torchao.quantization import quantize_\n\n"
        + py_set(
            "NVFP4_LAYERS",
            list(m.plan.low),
            "The Linear layers the map runs in NVFP4; every other Linear stays.",
        )
        + "\nconfig = NVFP4TrainingConfig()  # kernel_preference TRITON, the only one NVFP4Linear runs\n"
        "quantize_(\n"
        "    model,\n"
        "    config,\n"
        "    filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear) and fqn in NVFP4_LAYERS,\n"
        ")\n"
    )
    return MapText(
        body,
        runs=[
            "torchao's NVFP4 GEMM needs a Blackwell GPU with Triton, bf16 activations (it casts) and every "
            "dimension a multiple of 128, the tokens per GEMM (batch x sequence) included"
        ],
        cannot=[
            "single GEMM directions (NVFP4Linear runs all three in NVFP4; refused)",
            "mixprec's random bits: NVFP4Linear draws its own Hadamard signs and stochastic-rounding "
            "seeds, so it runs the same recipe, not the same numbers",
        ],
        fill_in="`model` (built, on its device); " + AUTOCAST_NOTE,
    )
