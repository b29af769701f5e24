"""The lint rules: stable ids (like ruff codes), a severity, a rationale, a source and a check.

Ids by family: MP1xx tensor-core shapes, MP2xx memory format, MP3xx precision mistakes,
MP4xx fusion. A rule's check takes a :class:`LintContext` (the traced forward pass, the
policy, the device) and yields :class:`Finding` objects; it never prints and never changes
the model.

Which hardware the tensor-core rules judge (``tensor_core=True``): the lint *target*, by
default the type of the device the policy runs on. Tensor cores are NVIDIA hardware, so on
a CPU target these rules still run (they describe the GPU the model will likely train on)
but every finding they make is ``info``: oneDNN on a CPU blocks channels and pads GEMMs
itself, and nothing there says an unaligned layer is slow. ``lint(target="cuda")`` (CLI
``--target cuda``) judges them at full severity from a machine without a GPU. Under a
policy that computes in strict fp32 no tensor core runs at all, so the alignment rules do
not apply and report nothing (the report says so).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from mixprec.linting.context import LintContext
from mixprec.linting.model import SEVERITIES, Finding, MeasuredGain, Remedy, Rule, define_rule
from mixprec.linting.trace import ATTENTION, FunctionCall, ModuleRecord
from mixprec.policy import check_support

# A classifier head with fewer outputs than this is the data's choice and tiny: not reported.
SMALL_HEAD = 64
VOCAB_MULTIPLE = 64
MIN_CONV_CHANNELS = 32
# cuDNN >= 8.3 fast grouped-convolution widths (channels per group), from seed 002.
GROUP_WIDTHS = (1, 4, 8, 16, 32, 64, 128, 256)
GROUPED_HEAVY = 0.25  # share of 2-D convolutions that are grouped, from which channels_last is suspect
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
_FP16_TINY = 2.0**-24  # smallest fp16 subnormal: anything below rounds to 0
_FP16_MIN_NORMAL = 2.0**-14

_CPU_NOTE = (
    " Tensor cores are NVIDIA hardware: on a CPU target this rule describes the GPU the model "
    "will likely train on and reports at info severity (oneDNN on a CPU blocks and pads by "
    "itself); lint --target cuda judges it at full severity."
)
_MEASURE_NOTE = (
    " Newer libraries relaxed the requirement (cuBLAS >= 11 and cuDNN >= 7.6.3 use tensor cores "
    "for unaligned sizes, padding internally or choosing slower kernels), so the cost ranges "
    "from nothing to a lot: --measure times the padded layer and the whole step."
)


# --------------------------------------------------------------------------------------------------
# Rules


RULES: dict[str, Rule] = {}


_rule = partial(define_rule, RULES)


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _dims(shape: tuple[int, ...] | None) -> str:
    return "[" + ", ".join(map(str, shape)) + "]" if shape else "?"


def _layer_shape(rec: ModuleRecord, what: str) -> str:
    inp = _dims(rec.input.shape) if rec.input else "?"
    out = _dims(rec.output.shape) if rec.output else "?"
    return f"{what} on {inp} -> {out}"


def _conv_desc(m: nn.Module) -> str:
    k = "x".join(map(str, m.kernel_size))
    groups = f", groups={m.groups}" if m.groups != 1 else ""
    return f"{type(m).__name__}({m.in_channels}, {m.out_channels}, k={k}{groups})"


def _pad_parts(label: str, n: int, a: int, to: int | None = None) -> str:
    return f"{label} {n} -> {to if to is not None else _up(n, a)}"


# ---- MP1xx: tensor-core shapes ------------------------------------------------------------------


@_rule(
    "MP101",
    "conv-channels",
    "warning",
    summary="Convolution channel counts should be multiples of 8 (fp16/bf16), 4 (tf32), 16 (fp8).",
    rationale=(
        "Tensor-core convolution kernels read channels in 16-byte vectors: in and out channels "
        "multiples of 8 for fp16/bf16, 4 for tf32, 16 for 8-bit types." + _MEASURE_NOTE + " The "
        "image stem's 3 input channels come from the data and are not reported (NVIDIA: padding "
        "them to 4 suffices for a stride-2 stem). Warning for a layer with at least 1% of the "
        "model's matmul/conv FLOPs, info below." + _CPU_NOTE
    ),
    source=(
        "seed 002 (channel dim 0 mod 8); NVIDIA Deep Learning Performance guide: Convolutional "
        "Layers (channels in and out) and Matrix Multiplication Background (Tensor Core requirements)"
    ),
    tensor_core=True,
    mechanical=True,
)
def _conv_channels(ctx: LintContext) -> Iterator[Finding]:
    rule = RULES["MP101"]
    for rec in ctx.convs:
        m = rec.module
        a = ctx.alignment_for(rec.name)
        if a is None or m.groups != 1:
            continue
        is_stem = rec.name == ctx.stem
        bad_in = m.in_channels % a != 0
        bad_out = m.out_channels % a != 0
        share = ctx.share(rec.flops)
        common = {"shape": _layer_shape(rec, _conv_desc(m)), "flops_share": share, "order": rec.order}
        if is_stem and bad_in:
            yield rule.finding(
                "info",
                rec.name,
                f"in_channels {m.in_channels} is not a multiple of {a} ({ctx.dtype})",
                _pad_parts("pad the input images' channels", m.in_channels, 4, 4),
                suppressed=(
                    f"image stem: its {m.in_channels} input channels come from the data "
                    "(NVIDIA: padding them to 4 suffices for a stride-2 stem)"
                ),
                details={"in_channels": m.in_channels, "alignment": a, "assumes": ctx.assumes},
                **common,
            )
            bad_in = False
        if not (bad_in or bad_out):
            continue
        parts, what = [], []
        if bad_in:
            parts.append(_pad_parts("in_channels", m.in_channels, a))
            what.append(f"in_channels {m.in_channels}")
        if bad_out:
            parts.append(_pad_parts("out_channels", m.out_channels, a))
            what.append(f"out_channels {m.out_channels}")
        yield rule.finding(
            ctx.share_severity(share),
            rec.name,
            f"{' and '.join(what)} not a multiple of {a} ({ctx.dtype})",
            "pad " + " and ".join(p.removeprefix("pad ") for p in parts),
            details={
                "in_channels": m.in_channels,
                "out_channels": m.out_channels,
                "alignment": a,
                "assumes": ctx.assumes,
            },
            remedy=Remedy(
                "pad",
                rec.name,
                in_to=_up(m.in_channels, a) if bad_in else None,
                out_to=_up(m.out_channels, a) if bad_out else None,
            ),
            **common,
        )


@_rule(
    "MP102",
    "conv-channels-small",
    "info",
    summary="Convolutions with fewer than 32 channels underuse tensor cores.",
    rationale=(
        "Seed 002 asks for channel dims >= 32 whenever possible: a narrow convolution is "
        "memory-bound and fills only part of a tensor-core tile. Reported only for counts that "
        "are already aligned (MP101 reports the others), and always at info: narrow layers are "
        "often deliberate. The fix --measure times is zero-padding the channels to 32." + _CPU_NOTE
    ),
    source="seed 002 (channel dim >= 32); NVIDIA Convolutional Layers guide (quantization effects)",
    tensor_core=True,
    mechanical=True,
)
def _conv_channels_small(ctx: LintContext) -> Iterator[Finding]:
    rule = RULES["MP102"]
    for rec in ctx.convs:
        m = rec.module
        a = ctx.alignment_for(rec.name)
        if a is None or m.groups != 1:
            continue
        if m.out_channels % a or (m.in_channels % a and rec.name != ctx.stem):
            continue  # MP101's
        small_in = m.in_channels < MIN_CONV_CHANNELS and rec.name != ctx.stem
        small_out = m.out_channels < MIN_CONV_CHANNELS
        if not (small_in or small_out):
            continue
        what = [
            f"{k} {v}"
            for k, v, s in (
                ("in_channels", m.in_channels, small_in),
                ("out_channels", m.out_channels, small_out),
            )
            if s
        ]
        parts = [
            f"{k} {v} -> {MIN_CONV_CHANNELS}"
            for k, v, s in (
                ("in_channels", m.in_channels, small_in),
                ("out_channels", m.out_channels, small_out),
            )
            if s
        ]
        yield rule.finding(
            "info",
            rec.name,
            f"{' and '.join(what)} below {MIN_CONV_CHANNELS}",
            f"widen to {MIN_CONV_CHANNELS} where the architecture allows (pad {' and '.join(parts)})",
            shape=_layer_shape(rec, _conv_desc(m)),
            flops_share=ctx.share(rec.flops),
            order=rec.order,
            details={"in_channels": m.in_channels, "out_channels": m.out_channels, "assumes": ctx.assumes},
            remedy=Remedy(
                "pad",
                rec.name,
                in_to=MIN_CONV_CHANNELS if small_in else None,
                out_to=MIN_CONV_CHANNELS if small_out else None,
            ),
        )


@_rule(
    "MP103",
    "grouped-conv",
    "warning",
    summary="Grouped convolutions need equal in/out channels and a supported group width.",
    rationale=(
        "Seed 002: for grouped convolutions make in_channels equal out_channels and the channels "
        "per group one of {4, 8, 16, 32} (cuDNN 8.2) or {1, 4, 8, 16, 32, 64, 128, 256} (cuDNN "
        "8.3 and later; 1 is depthwise). Other grouped shapes run generic, much slower kernels. "
        "Warning from 1% of the model's FLOPs, info below." + _CPU_NOTE
    ),
    source="seed 002 (grouped convolutions)",
    tensor_core=True,
)
def _grouped_conv(ctx: LintContext) -> Iterator[Finding]:
    rule = RULES["MP103"]
    widths = ", ".join(map(str, GROUP_WIDTHS))
    for rec in ctx.convs:
        m = rec.module
        if m.groups == 1 or ctx.alignment_for(rec.name) is None:
            continue
        width = m.in_channels // m.groups
        problems, fixes = [], []
        if m.in_channels != m.out_channels:
            problems.append(f"in_channels {m.in_channels} != out_channels {m.out_channels}")
            fixes.append(f"out_channels {m.out_channels} -> {m.in_channels}")
        if width not in GROUP_WIDTHS:
            problems.append(f"{width} channels per group (cuDNN fast widths: {widths})")
            near = min(GROUP_WIDTHS, key=lambda w: (abs(w - width), -w))
            fixes.append(f"channels per group {width} -> {near} (groups {m.in_channels // near})")
        if not problems:
            continue
        share = ctx.share(rec.flops)
        yield rule.finding(
            ctx.share_severity(share),
            rec.name,
            "grouped conv with " + " and ".join(problems),
            "use " + " and ".join(fixes),
            shape=_layer_shape(rec, _conv_desc(m)),
            flops_share=share,
            order=rec.order,
            details={
                "in_channels": m.in_channels,
                "out_channels": m.out_channels,
                "groups": m.groups,
                "channels_per_group": width,
            },
        )


@_rule(
    "MP104",
    "linear-features",
    "warning",
    summary="Linear in/out features should be multiples of 8 (fp16/bf16), 4 (tf32), 16 (fp8).",
    rationale=(
        "A Linear layer runs three GEMMs (forward, input gradient, weight gradient) whose leading "
        "dimensions are in_features and out_features: tensor cores want them 16-byte aligned, "
        "multiples of 8 for fp16/bf16, 4 for tf32, 16 for fp8." + _MEASURE_NOTE + " A classifier "
        f"head with fewer than {SMALL_HEAD} outputs is not reported: the class count comes from "
        "the data and the layer is tiny. Language-model heads are MP105's. Warning from 1% of the "
        "model's FLOPs, info below." + _CPU_NOTE
    ),
    source=(
        "NVIDIA Deep Learning Performance guide: Linear/Fully-Connected Layers (quick-start "
        "checklist), Matrix Multiplication Background (Tensor Core requirements); padding that "
        "helped (tensorflow/models#7407) and that did not (allenai/allennlp#4929)"
    ),
    tensor_core=True,
    mechanical=True,
)
def _linear_features(ctx: LintContext) -> Iterator[Finding]:
    rule = RULES["MP104"]
    for rec in ctx.linears:
        m = rec.module
        a = ctx.alignment_for(rec.name)
        if a is None or rec.name in ctx.vocab_projections:
            continue
        bad_in = m.in_features % a != 0
        bad_out = m.out_features % a != 0
        if not (bad_in or bad_out):
            continue
        share = ctx.share(rec.flops)
        shape = _layer_shape(rec, f"Linear({m.in_features}, {m.out_features})")
        details = {"in_features": m.in_features, "out_features": m.out_features, "alignment": a}
        details["assumes"] = ctx.assumes
        if bad_out and rec.name == ctx.head and m.out_features < SMALL_HEAD:
            yield rule.finding(
                "info",
                rec.name,
                f"out_features {m.out_features} not a multiple of {a} ({ctx.dtype})",
                _pad_parts("pad out_features", m.out_features, a),
                shape=shape,
                flops_share=share,
                order=rec.order,
                details=details,
                suppressed=(
                    f"classifier head with {m.out_features} outputs: the class count comes from "
                    "the data and the layer is too small to matter"
                ),
            )
            bad_out = False
            if not bad_in:
                continue
        parts, what = [], []
        if bad_in:
            parts.append(_pad_parts("in_features", m.in_features, a))
            what.append(f"in_features {m.in_features}")
        if bad_out:
            parts.append(_pad_parts("out_features", m.out_features, a))
            what.append(f"out_features {m.out_features}")
        yield rule.finding(
            ctx.share_severity(share),
            rec.name,
            f"{' and '.join(what)} not a multiple of {a} ({ctx.dtype})",
            "pad " + " and ".join(parts),
            shape=shape,
            flops_share=share,
            order=rec.order,
            details=details,
            remedy=Remedy(
                "pad",
                rec.name,
                in_to=_up(m.in_features, a) if bad_in else None,
                out_to=_up(m.out_features, a) if bad_out else None,
            ),
        )


@_rule(
    "MP105",
    "vocab-size",
    "warning",
    summary=f"Pad a language model's vocabulary to a multiple of {VOCAB_MULTIPLE}.",
    rationale=(
        "The output projection of a language model (often tied to the token embedding) is "
        "usually its largest GEMM, and the vocabulary is that GEMM's N dimension. Padding the "
        f"vocabulary to a multiple of {VOCAB_MULTIPLE} keeps every tile full (nanoGPT: 50257 -> "
        "50304); the extra logits never get a target. Warning when the size is not even a "
        f"multiple of the tensor-core alignment, info when it is but not of {VOCAB_MULTIPLE}. "
        "Reported only for an embedding with an output projection of its size (a lookup alone "
        "uses no tensor cores)." + _CPU_NOTE
    ),
    source=(
        "NVIDIA Linear/Fully-Connected Layers guide (vocabulary size: padding a Transformer's "
        "vocabulary to a multiple of 8); karpathy/nanoGPT (vocab_size 50304); Megatron-LM "
        "(--make-vocab-size-divisible-by)"
    ),
    tensor_core=True,
    mechanical=True,
)
def _vocab_size(ctx: LintContext) -> Iterator[Finding]:
    rule = RULES["MP105"]
    seen: set[str] = set()
    for lin_name, (emb_name, emb, tied) in ctx.vocab_projections.items():
        a = ctx.alignment_for(lin_name)
        vocab = emb.module.num_embeddings
        if a is None or vocab % VOCAB_MULTIPLE == 0 or emb_name in seen:
            continue
        seen.add(emb_name)
        lin = ctx.trace.modules[lin_name]
        share = ctx.share(lin.flops)
        padded = _up(vocab, VOCAB_MULTIPLE)
        severity = ctx.share_severity(share) if vocab % a else "info"
        how = "tied to" if tied else "sized like"
        yield rule.finding(
            severity,
            emb_name,
            f"vocab size {vocab} is not a multiple of {VOCAB_MULTIPLE}"
            + ("" if vocab % a == 0 else f" (nor of {a}, {ctx.dtype})")
            + f"; output projection {lin_name} is {how} the embedding",
            f"pad vocab_size {vocab} -> {padded} (the {padded - vocab} extra logits never get a target)",
            shape=_layer_shape(lin, f"{lin_name}: Linear({lin.module.in_features}, {vocab})"),
            flops_share=share,
            order=emb.order,
            details={"vocab_size": vocab, "projection": lin_name, "tied": tied, "assumes": ctx.assumes},
            remedy=Remedy("pad", lin_name, out_to=padded),
        )


@_rule(
    "MP106",
    "batch-size",
    "info",
    summary="Batch sizes that are multiples of 8 keep Linear GEMMs aligned.",
    rationale=(
        "NVIDIA's guides ask for batch sizes divisible by 8 (fp16). For a Linear layer on a 2-D "
        "input the batch is the GEMM's M dimension, which is not a leading dimension of any of "
        "its three GEMMs, so current cuBLAS is rarely affected: this is the advice users most "
        "often find makes no difference. Info only; convolutions are not affected (their M is "
        "batch x height x width). Measure throughput before changing the batch size." + _CPU_NOTE
    ),
    source="NVIDIA Linear/Fully-Connected Layers guide (batch size); allenai/allennlp#4929",
    tensor_core=True,
)
def _batch_size(ctx: LintContext) -> Iterator[Finding]:
    a = ctx.alignment
    b = ctx.batch_size
    if a is None or b % a == 0:
        return
    hit = [
        r
        for r in ctx.linears
        if r.input is not None
        and len(r.input.shape) == 2
        and r.input.shape[0] == b
        and ctx.alignment_for(r.name)
    ]
    if not hit:
        return
    names = [r.name for r in hit]
    yield RULES["MP106"].finding(
        "info",
        None,
        f"batch size {b} is not a multiple of {a} ({ctx.dtype}); it is the M dimension of "
        f"{len(hit)} Linear layer{'s' if len(hit) > 1 else ''}",
        f"batch size {b} -> {_up(b, a)} (measure throughput: often no difference)",
        shape=f"{names[0]} input {_dims(hit[0].input.shape)}"
        + (f" (+{len(hit) - 1} more)" if len(hit) > 1 else ""),
        flops_share=ctx.share(sum(r.flops for r in hit)),
        order=hit[0].order,
        details={"batch_size": b, "layers": names, "assumes": ctx.assumes},
    )


def _sequence_length(call: FunctionCall) -> int | None:
    if call.name == "scaled_dot_product_attention" and call.args:
        return call.args[0].shape[-2] if len(call.args[0].shape) >= 2 else None
    if call.name == "multi_head_attention_forward" and call.args:
        return call.args[0].shape[0]
    return None


@_rule(
    "MP107",
    "sequence-length",
    "info",
    summary="Sequence lengths that are multiples of 8 keep attention and Linear GEMMs aligned.",
    rationale=(
        "Transformer Linear layers see batch x sequence as their M dimension, and attention's "
        "score matrices have the sequence length as a leading dimension: multiples of 8 keep "
        "those GEMMs aligned. Fused attention kernels (flash, memory-efficient) handle any "
        "length, so the effect is usually small: info only." + _CPU_NOTE
    ),
    source="NVIDIA Deep Learning Performance guide (GEMM dimensions multiples of 8); PyTorch SDPA kernels",
    tensor_core=True,
)
def _sequence_length_rule(ctx: LintContext) -> Iterator[Finding]:
    a = ctx.alignment
    if a is None:
        return
    where: dict[str, int] = {}  # module -> sequence length
    for call in ctx.trace.calls_named(ATTENTION):
        t = _sequence_length(call)
        if t is not None and t % a:
            where.setdefault(call.module or "", t)
    for rec in ctx.linears:
        shape = rec.input.shape if rec.input else ()
        if len(shape) >= 3 and math.prod(shape[:-1]) % a and ctx.alignment_for(rec.name):
            t = shape[1] if shape[0] == ctx.batch_size else shape[0]
            where.setdefault(rec.name, t)
    if not where:
        return
    lengths = sorted(set(where.values()))
    t = lengths[0]
    names = list(where)
    yield RULES["MP107"].finding(
        "info",
        names[0],
        f"sequence length {', '.join(map(str, lengths))} is not a multiple of {a} ({ctx.dtype}), "
        f"in {len(names)} layer{'s' if len(names) > 1 else ''}",
        f"use sequence length {_up(t, a)} (pad {t} -> {_up(t, a)} with ignored tokens)",
        shape=f"{len(names)} layers: {', '.join(n or '(model forward)' for n in names[:4])}"
        + (", ..." if len(names) > 4 else ""),
        details={"sequence_lengths": lengths, "layers": names, "assumes": ctx.assumes},
    )


@_rule(
    "MP108",
    "attention-head-dim",
    "warning",
    summary="Flash attention needs a head dimension that is a multiple of 8 and at most 256.",
    rationale=(
        "PyTorch's flash-attention kernel for scaled_dot_product_attention needs fp16/bf16 "
        "inputs and a head dimension that is a multiple of 8 and at most 256 (128 in older "
        "releases); otherwise SDPA falls back to the memory-efficient or the math kernel, which "
        "is slower and, for the math kernel, materialises the full score matrix. Applies to "
        "fp16/bf16 policies only." + _CPU_NOTE
    ),
    source="pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (flash-attention head-dim check)",
    tensor_core=True,
)
def _attention_head_dim(ctx: LintContext) -> Iterator[Finding]:
    if ctx.dtype not in ("fp16", "bf16"):
        return
    seen: set[tuple[str | None, int]] = set()
    for call in ctx.trace.calls_named(ATTENTION):
        if not call.args:
            continue
        if call.name == "scaled_dot_product_attention":
            d = call.args[0].shape[-1]
        else:
            heads = int(call.kwargs.get("num_heads") or 1)
            d = call.args[0].shape[-1] // max(heads, 1)
        if (d % 8 == 0 and d <= 256) or (call.module, d) in seen:
            continue
        seen.add((call.module, d))
        target = min(256, _up(d, 8))
        yield RULES["MP108"].finding(
            "warning",
            call.module,
            f"attention head dim {d} " + ("exceeds 256" if d > 256 else "is not a multiple of 8"),
            f"choose embed_dim / num_heads = {target} (e.g. change the number of heads)",
            shape=f"{call.name} on " + ", ".join(_dims(t.shape) for t in call.args[:3]),
            details={"head_dim": d},
        )


# ---- MP2xx: memory format -----------------------------------------------------------------------


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
        "layout transposes around its convolutions. Seed 002 and NVIDIA recommend channels_last "
        "for CNNs, and it is much of the mixed-precision gain on ResNet-50 (A100: 938 img/s TF32 "
        "NCHW vs 2470 img/s AMP + channels_last, NVIDIA DeepLearningExamples). Warning when the "
        "policy computes in fp16/bf16/tf32, or on CPU with bf16 math; info under strict fp32 on "
        "CPU; not reported under strict fp32 on CUDA (no tensor cores), nor for grouped/depthwise-"
        "heavy models, where channels_last is known to regress (MP202)."
    ),
    source=(
        "seed 002 (NHWC); NVIDIA Convolutional Layers guide (tensor layouts: NCHW vs NHWC); "
        "PyTorch channels_last tutorial"
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
    yield RULES["MP201"].finding(
        severity,
        None,
        f"model runs NCHW; its {len(convs)} Conv2d layers ({share:.0%} of the FLOPs) would use NHWC kernels",
        _layout_fix(ctx, True) + "; by hand: model and 4-D inputs to memory_format=torch.channels_last",
        shape=f"first conv input {_dims(convs[0].input.shape if convs[0].input else None)} NCHW",
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
    yield RULES["MP202"].finding(
        "warning",
        None,
        f"runs channels_last with {len(grouped)} of {len(convs)} Conv2d layers grouped/depthwise "
        "(channels_last is known to regress there)",
        "measure both layouts (--measure); keep NCHW if it wins: " + _layout_fix(ctx, False),
        shape=f"e.g. {grouped[0].name}: {_conv_desc(grouped[0].module)}",
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
        "its input first (seed 002 spells out this trap). A channels_last policy converts the "
        "model's inputs itself and is not reported."
    ),
    source="seed 002 (model.to(...) is in place, batch.to(...) is not)",
    mechanical=True,
)
def _channels_last_input(ctx: LintContext) -> Iterator[Finding]:
    rule = RULES["MP203"]
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
                shape=_layer_shape(rec, _conv_desc(rec.module)),
                flops_share=ctx.share(rec.flops),
                order=rec.order,
                remedy=Remedy("layout", channels_last=True),
            )


# ---- MP3xx: precision mistakes ------------------------------------------------------------------


@_rule(
    "MP301",
    "bce-under-autocast",
    "error",
    summary="binary_cross_entropy / BCELoss under autocast: use the with-logits form.",
    rationale=(
        "binary_cross_entropy on probabilities is unsafe in half precision (the sigmoid before "
        "it saturates); CUDA autocast refuses it with a RuntimeError, while CPU autocast runs it, "
        "so code tried on a CPU crashes on the GPU. binary_cross_entropy_with_logits fuses the "
        "sigmoid and is autocast-safe. Error on a CUDA target, warning on CPU; *-mixed policies only."
    ),
    source=(
        "PyTorch AMP docs (autocast op reference, binary_cross_entropy); FIELD-NOTES (CUDA vs CPU autocast)"
    ),
)
def _bce_under_autocast(ctx: LintContext) -> Iterator[Finding]:
    if ctx.policy.spec.autocast_dtype is None:
        return
    seen: set[str | None] = set()
    for call in ctx.trace.calls_named({"binary_cross_entropy"}):
        if call.module in seen:
            continue
        seen.add(call.module)
        where = "in the loss function" if call.module is None else "in the model"
        yield RULES["MP301"].finding(
            "error" if ctx.cuda_target else "warning",
            call.module,
            f"binary_cross_entropy under autocast ({ctx.policy.name}) {where}: "
            + ("raises on CUDA" if ctx.cuda_target else "runs on CPU autocast, raises under CUDA autocast"),
            "return logits and use F.binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss "
            "(drop the sigmoid)",
            shape="binary_cross_entropy on " + ", ".join(_dims(t.shape) for t in call.args[:2]),
            details={"scope": "loss_fn"} if call.module is None else {},
        )


@_rule(
    "MP302",
    "adam-eps-fp16",
    "error",
    summary="Adam-style eps below the fp16 range with fp16 parameters divides by zero.",
    rationale=(
        "With fp16 parameters, Adam-family optimizers keep their state in fp16 and add eps to "
        "sqrt(v) in fp16: eps=1e-8 rounds to 0 (the smallest fp16 subnormal is 6e-8), so a "
        "parameter whose gradient history underflows divides by zero. Error below 2^-24, warning "
        "below the smallest normal fp16 (6.1e-5). Mixed policies keep fp32 master weights and "
        "are not affected."
    ),
    source="pytorch/pytorch#8860",
)
def _adam_eps(ctx: LintContext) -> Iterator[Finding]:
    opt = ctx.optimizer
    if opt is None:
        return
    fp16_params = ctx.policy.spec.param_dtype == torch.float16 or any(
        p.dtype == torch.float16 for p in ctx.workload.model.parameters()
    )
    if not fp16_params:
        return
    for i, group in enumerate(opt.param_groups):
        eps = group.get("eps")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps >= _FP16_MIN_NORMAL:
            continue
        zero = eps < _FP16_TINY
        yield RULES["MP302"].finding(
            "error" if zero else "warning",
            None,
            f"{type(opt).__name__} eps={eps:g} "
            + ("rounds to 0 in fp16" if zero else "is subnormal in fp16")
            + " and the parameters are fp16"
            + (f" (param group {i})" if len(opt.param_groups) > 1 else ""),
            "eps=1e-4 (at least 6.1e-5, the smallest normal fp16), or keep fp32 master weights: fp16-mixed",
            details={"optimizer": type(opt).__name__, "eps": eps, "param_group": i, "scope": "optimizer"},
        )


@_rule(
    "MP303",
    "gradscaler-bf16",
    "warning",
    summary="A GradScaler with bf16 only costs time: bf16 has fp32's exponent range.",
    rationale=(
        "Loss scaling exists because fp16 gradients underflow; bf16 has fp32's exponent range, so "
        "a GradScaler with bf16 only adds a host synchronisation and needlessly skipped steps. "
        "Detected when an enabled torch.amp.GradScaler is reachable from the workload (its "
        "attributes, or its functions' closures and globals) and the policy computes in bf16."
    ),
    source="PyTorch automatic mixed precision docs (gradient scaling is for float16)",
)
def _gradscaler_bf16(ctx: LintContext) -> Iterator[Finding]:
    if ctx.dtype != "bf16" or not ctx.grad_scalers:
        return
    yield RULES["MP303"].finding(
        "warning",
        None,
        f"an enabled GradScaler is used with {ctx.policy.name}",
        "drop the GradScaler (mixprec's bf16 policies scale nothing; finite_check=True skips "
        "non-finite steps instead)",
        details={"scalers": len(ctx.grad_scalers), "scope": "GradScaler"},
    )


def _device_rule_applies(ctx: LintContext) -> bool:
    return ctx.target == ctx.device.type


@_rule(
    "MP304",
    "bf16-not-native",
    "error",
    summary="bf16 on a device without native bf16 is emulated and slower than fp32.",
    rationale=(
        "GPUs before compute capability 8.0 have no bf16 tensor cores: bf16 runs emulated and "
        "slower than fp32, even where torch.cuda.is_bf16_supported() says True "
        "(kubeedge/ianvs#888). CPUs without AVX512-BF16 or AMX emulate bf16 too. Error on a GPU, "
        "warning on a CPU. Judged against the device the policy runs on, so not reported when "
        "lint's target differs from that device."
    ),
    source="FIELD-NOTES ('bf16/AMP is slower than fp32'); kubeedge/ianvs#888",
)
def _bf16_not_native(ctx: LintContext) -> Iterator[Finding]:
    if ctx.policy.spec.low_precision_dtype != torch.bfloat16 or not _device_rule_applies(ctx):
        return
    if ctx.device.native_bf16:
        return
    support = check_support(ctx.policy.name, ctx.device)
    yield RULES["MP304"].finding(
        "error" if ctx.device.type == "cuda" else "warning",
        None,
        f"{ctx.policy.name} on {ctx.device.name}: {support.reason}",
        f"use {support.suggestion or 'fp32'} on this device",
        details={"device": ctx.device.name, "capability": ctx.device.capability, "scope": "policy"},
    )


@_rule(
    "MP305",
    "fp16-not-native",
    "error",
    summary="fp16 on a device without native fp16 is emulated and far slower than fp32.",
    rationale=(
        "fp16 math needs tensor cores (compute capability >= 7.0) on a GPU and AVX512-FP16 or "
        "AMX-FP16 on a CPU; elsewhere it is emulated: fp16 autocast on an AVX512-BF16 EPYC was "
        "measured about 25x slower than fp32. Judged against the device the policy runs on."
    ),
    source="FIELD-NOTES (fp16 autocast ~25x slower than fp32 on this CPU class)",
)
def _fp16_not_native(ctx: LintContext) -> Iterator[Finding]:
    if ctx.policy.spec.low_precision_dtype != torch.float16 or not _device_rule_applies(ctx):
        return
    if ctx.device.native_fp16:
        return
    support = check_support(ctx.policy.name, ctx.device)
    yield RULES["MP305"].finding(
        "error",
        None,
        f"{ctx.policy.name} on {ctx.device.name}: {support.reason}",
        f"use {support.suggestion or 'fp32'} on this device",
        details={"device": ctx.device.name, "capability": ctx.device.capability, "scope": "policy"},
    )


# ---- MP4xx: fusion ------------------------------------------------------------------------------


@_rule(
    "MP401",
    "unfused-activation",
    "info",
    summary="Activations outside cuDNN's fused list run as a separate kernel.",
    rationale=(
        "cuDNN's fused convolution + bias + activation kernels and fused GEMM epilogues cover a "
        "short list of activations (seed 002: relu, tanh, sigmoid, elu, gelu, softplus, swish); "
        "any other runs as a separate kernel that reads and writes the whole activation again. "
        "Eager PyTorch never fuses, so this matters once the model is compiled, exported or "
        "fused (torch.compile, TensorRT): info." + _CPU_NOTE
    ),
    source="seed 002 (activation functions)",
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
        yield RULES["MP401"].finding(
            "info",
            call.module,
            f"{base} is not on the fused-activation list",
            f"use {_ACTIVATION_SUBSTITUTES[base]} where accuracy allows "
            f"(fused: {', '.join(FUSED_ACTIVATIONS)})",
            shape=f"{base} on " + (_dims(call.args[0].shape) if call.args else "?"),
            order=order,
            details={"activation": base},
        )


__all__ = [
    "RULES",
    "SEVERITIES",
    "Finding",
    "LintContext",
    "MeasuredGain",
    "Remedy",
    "Rule",
]
