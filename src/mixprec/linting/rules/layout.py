"""MP2xx: memory format. channels_last (NHWC) where the kernels are NHWC, not where it is
known to regress, and the inputs a channels_last model is fed."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

from torch import nn

from mixprec.linting.context import LintContext
from mixprec.linting.model import Finding, Remedy, Rule, define_rule
from mixprec.linting.rules.text import conv_desc, dims, layer_shape
from mixprec.linting.trace import ModuleRecord

LAYOUT_RULES: dict[str, Rule] = {}
_rule = partial(define_rule, LAYOUT_RULES)

GROUPED_HEAVY = 0.25  # share of 2-D convolutions that are grouped, from which channels_last is suspect


def _conv2d(ctx: LintContext) -> list[ModuleRecord]:
    return [r for r in ctx.convs if isinstance(r.module, nn.Conv2d)]


def _grouped_fraction(convs: list[ModuleRecord]) -> float:
    return sum(1 for r in convs if r.module.groups > 1) / len(convs) if convs else 0.0


def _layout_fix(ctx: LintContext, on: bool) -> str:
    flag = "on" if on else "off"
    return f"get_policy({ctx.policy.name!r}, channels_last={on}) (CLI: --channels-last {flag})"


@_rule(
    "MP201",
    "channels-last",
    "warning",
    summary="Run convolutional models channels_last (NHWC) where the device's kernels are NHWC.",
    rationale=(
        "Tensor-core convolutions (cuDNN) and oneDNN on CPU work in NHWC; an NCHW model pays "
        "layout transposes around its convolutions. SURF's A100 guide and NVIDIA recommend "
        "channels_last for CNNs, and it is much of the mixed-precision gain on ResNet-50 (A100: "
        "938 img/s TF32 NCHW vs 2470 img/s AMP + channels_last, NVIDIA DeepLearningExamples). "
        "Warning when the policy computes in fp16/bf16/tf32, or on CPU with bf16 math; info under "
        "strict fp32 on CPU; not reported under strict fp32 on CUDA (no tensor cores), nor for "
        "grouped/depthwise-heavy models, where channels_last is known to regress (MP202)."
    ),
    source=(
        "SURF, 'Deep Learning on A100 GPUs' (NHWC); NVIDIA Convolutional Layers guide (tensor "
        "layouts: NCHW vs NHWC); PyTorch channels_last tutorial"
    ),
    mechanical=True,
)
def _channels_last(ctx: LintContext) -> Iterator[Finding]:
    convs = _conv2d(ctx)
    if not convs or ctx.policy.config.channels_last or ctx.trace.model_channels_last:
        return
    if _grouped_fraction(convs) >= GROUPED_HEAVY:
        return
    if ctx.cuda_target:
        if ctx.dtype not in ("fp16", "bf16", "tf32"):
            return
        severity = "warning"
    else:
        severity = "info" if ctx.dtype == "fp32" else "warning"
    share = ctx.share(sum(r.flops for r in convs))
    if share < 0.1:
        severity = "info"
    yield LAYOUT_RULES["MP201"].finding(
        severity,
        None,
        f"model runs NCHW; its {len(convs)} Conv2d layers ({share:.0%} of the FLOPs) would use NHWC kernels",
        _layout_fix(ctx, True) + "; by hand: model and 4-D inputs to memory_format=torch.channels_last",
        shape=f"first conv input {dims(convs[0].input.shape if convs[0].input else None)} NCHW",
        flops_share=share,
        order=convs[0].order,
        details={"conv2d_layers": len(convs), "dtype": ctx.dtype},
        remedy=Remedy("layout", channels_last=True),
    )


@_rule(
    "MP202",
    "channels-last-grouped",
    "warning",
    summary="channels_last can slow down grouped/depthwise-heavy models: measure both layouts.",
    rationale=(
        "channels_last has been measured slower for grouped and depthwise convolutions "
        "(pytorch/pytorch#34977, #50036, #44943; timm: regnety_032 29% slower). Reported when "
        f"at least {GROUPED_HEAVY:.0%} of the 2-D convolutions are grouped and the model runs "
        "channels_last; --measure times both layouts."
    ),
    source="pytorch/pytorch#34977, #50036, #44943; timm benchmark results (regnety_032)",
    mechanical=True,
)
def _channels_last_grouped(ctx: LintContext) -> Iterator[Finding]:
    convs = _conv2d(ctx)
    on = ctx.policy.config.channels_last or ctx.trace.model_channels_last
    fraction = _grouped_fraction(convs)
    if not convs or not on or fraction < GROUPED_HEAVY:
        return
    grouped = [r for r in convs if r.module.groups > 1]
    yield LAYOUT_RULES["MP202"].finding(
        "warning",
        None,
        f"runs channels_last with {len(grouped)} of {len(convs)} Conv2d layers grouped/depthwise "
        "(channels_last is known to regress there)",
        "measure both layouts (--measure); keep NCHW if it wins: " + _layout_fix(ctx, False),
        shape=f"e.g. {grouped[0].name}: {conv_desc(grouped[0].module)}",
        order=grouped[0].order,
        details={"grouped_fraction": fraction, "grouped_layers": [r.name for r in grouped]},
        remedy=Remedy("layout", channels_last=False),
    )


@_rule(
    "MP203",
    "channels-last-input",
    "warning",
    summary="A channels_last model fed NCHW inputs converts them at every such convolution.",
    rationale=(
        "model.to(memory_format=torch.channels_last) converts the weights in place, but "
        "batch.to(memory_format=...) returns a new tensor: forgetting to reassign it, or to "
        "convert at all, feeds NCHW inputs to a channels_last model and the convolution converts "
        "its input first (SURF's A100 guide spells out this trap). A channels_last policy converts "
        "the model's inputs itself and is not reported."
    ),
    source="SURF, 'Deep Learning on A100 GPUs' (model.to(...) is in place, batch.to(...) is not)",
    mechanical=True,
)
def _channels_last_input(ctx: LintContext) -> Iterator[Finding]:
    rule = LAYOUT_RULES["MP203"]
    for rec in _conv2d(ctx):
        if rec.weight is None or rec.input is None:
            continue
        if rec.weight.channels_last and rec.input.nchw:
            yield rule.finding(
                "warning",
                rec.name,
                "channels_last weights but an NCHW input",
                "convert the input: x = x.contiguous(memory_format=torch.channels_last), or "
                + _layout_fix(ctx, True),
                shape=layer_shape(rec, conv_desc(rec.module)),
                flops_share=ctx.share(rec.flops),
                order=rec.order,
                remedy=Remedy("layout", channels_last=True),
            )


__all__ = ["GROUPED_HEAVY", "LAYOUT_RULES"]
