"""MP4xx: fusion. Activations that cuDNN's fused kernels and GEMM epilogues do not cover."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

from mixprec.linting.context import LintContext
from mixprec.linting.model import Finding, Rule, define_rule
from mixprec.linting.rules.text import CPU_NOTE, dims

FUSION_RULES: dict[str, Rule] = {}
_rule = partial(define_rule, FUSION_RULES)

FUSED_ACTIVATIONS = ("relu", "tanh", "sigmoid", "elu", "gelu", "softplus", "silu")
# Unfused activation -> the nearest activation on the fused list.
_ACTIVATION_SUBSTITUTES = {
    "leaky_relu": "relu",
    "relu6": "relu",
    "hardtanh": "relu (or a clamp, if it is one)",
    "hardswish": "silu (swish)",
    "hardsigmoid": "sigmoid",
    "mish": "silu (swish)",
    "selu": "elu",
    "celu": "elu",
    "prelu": "relu",
    "rrelu": "relu",
    "glu": "gelu or silu gating",
    "logsigmoid": "sigmoid",
    "softsign": "tanh",
    "tanhshrink": "tanh",
    "softshrink": "relu",
    "hardshrink": "relu",
    "threshold": "relu",
}


@_rule(
    "MP401",
    "unfused-activation",
    "info",
    summary="Activations outside cuDNN's fused list run as a separate kernel.",
    rationale=(
        "cuDNN's fused convolution + bias + activation kernels and fused GEMM epilogues cover a "
        "short list of activations (SURF's A100 guide lists relu, tanh, sigmoid, elu, gelu, "
        "softplus, swish); any other runs as a separate kernel that reads and writes the whole "
        "activation again. Eager PyTorch never fuses, so this matters once the model is compiled, "
        "exported or fused (torch.compile, TensorRT): info." + CPU_NOTE
    ),
    source="SURF, 'Deep Learning on A100 GPUs' (activation functions)",
    tensor_core=True,
)
def _unfused_activation(ctx: LintContext) -> Iterator[Finding]:
    fused = set(FUSED_ACTIVATIONS) | {a + "_" for a in FUSED_ACTIVATIONS}
    seen: set[tuple[str | None, str]] = set()
    for call in ctx.trace.calls:
        base = call.name.rstrip("_")
        if base not in _ACTIVATION_SUBSTITUTES or call.name in fused or (call.module, base) in seen:
            continue
        seen.add((call.module, base))
        order = ctx.trace.modules[call.module].order if call.module in ctx.trace.modules else 0
        yield FUSION_RULES["MP401"].finding(
            "info",
            call.module,
            f"{base} is not on the fused-activation list",
            f"use {_ACTIVATION_SUBSTITUTES[base]} where accuracy allows "
            f"(fused: {', '.join(FUSED_ACTIVATIONS)})",
            shape=f"{base} on " + (dims(call.args[0].shape) if call.args else "?"),
            order=order,
            details={"activation": base},
        )


__all__ = ["FUSED_ACTIVATIONS", "FUSION_RULES"]
