"""MP1xx: tensor-core shapes. Channel, feature, vocabulary, batch, sequence and head sizes
that tensor cores want aligned.

Every rule here is ``tensor_core=True``: on a CPU target it reports at info (the runner
lowers it). Under a policy that computes in strict fp32 no tensor core runs, the alignment
is None and these rules report nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial
from typing import Any

from mixprec.linting.context import LintContext
from mixprec.linting.model import Finding, Remedy, Rule, define_rule
from mixprec.linting.rules.text import CPU_NOTE, conv_desc, dims, layer_shape
from mixprec.linting.trace import ATTENTION, FunctionCall, ModuleRecord
from mixprec.policy.fp8 import FP8_DIVISOR

SHAPE_RULES: dict[str, Rule] = {}
_rule = partial(define_rule, SHAPE_RULES)

# A classifier head with fewer outputs than this is the data's choice and tiny: not reported.
SMALL_HEAD = 64
VOCAB_MULTIPLE = 64
MIN_CONV_CHANNELS = 32
# cuDNN >= 8.3 fast grouped-convolution widths (channels per group), from SURF's 'Deep Learning on
# A100 GPUs' guide, whose tips follow NVIDIA's cuDNN developer guide.
GROUP_WIDTHS = (1, 4, 8, 16, 32, 64, 128, 256)

_MEASURE_NOTE = (
    " Newer libraries relaxed the requirement (cuBLAS >= 11 and cuDNN >= 7.6.3 use tensor cores "
    "for unaligned sizes, padding internally or choosing slower kernels), so the cost ranges "
    "from nothing to a lot: --measure times the padded layer and the whole step."
)


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_plan(
    layer: str, label: str, sizes: tuple[int, int], to: tuple[int | None, int | None]
) -> tuple[str, str, Remedy]:
    """Padding ``layer``'s (in, out) ``sizes`` of ``label`` to ``to`` (None: that side stays):
    what is off ('in_channels 30'), the padding ('in_channels 30 -> 32') and its :class:`Remedy`."""
    sides = [
        (f"{io}_{label}", n, t) for io, n, t in zip(("in", "out"), sizes, to, strict=True) if t is not None
    ]
    what = " and ".join(f"{side} {n}" for side, n, _ in sides)
    pad = " and ".join(f"{side} {n} -> {t}" for side, n, t in sides)
    return what, pad, Remedy("pad", layer, in_to=to[0], out_to=to[1])


def _misaligned(
    ctx: LintContext,
    rule: Rule,
    rec: ModuleRecord,
    label: str,
    sizes: tuple[int, int],
    bad: tuple[bool, bool],
    a: int,
    **kw: Any,
) -> Finding:
    """MP101/MP104's finding: the (in, out) ``sizes`` flagged ``bad`` are not multiples of ``a``;
    the fix pads them to the next multiple. ``kw``: the finding's other fields."""
    to = (_up(sizes[0], a) if bad[0] else None, _up(sizes[1], a) if bad[1] else None)
    what, pad, remedy = _pad_plan(rec.name, label, sizes, to)
    return rule.finding(
        ctx.share_severity(ctx.share(rec.flops)),
        rec.name,
        f"{what} not a multiple of {a} ({ctx.dtype})",
        "pad " + pad,
        remedy=remedy,
        **kw,
    )


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
        "model's matmul/conv FLOPs, info below." + CPU_NOTE
    ),
    source=(
        "SURF, 'Deep Learning on A100 GPUs' (channel dim 0 mod 8); NVIDIA Deep Learning Performance "
        "guide: Convolutional Layers (channels in and out) and Matrix Multiplication Background "
        "(Tensor Core requirements)"
    ),
    tensor_core=True,
    mechanical=True,
)
def _conv_channels(ctx: LintContext) -> Iterator[Finding]:
    rule = SHAPE_RULES["MP101"]
    for rec in ctx.convs:
        m = rec.module
        a = ctx.alignment_for(rec.name)
        if a is None or m.groups != 1:
            continue
        is_stem = rec.name == ctx.stem
        bad_in = m.in_channels % a != 0
        bad_out = m.out_channels % a != 0
        share = ctx.share(rec.flops)
        common = {"shape": layer_shape(rec, conv_desc(m)), "flops_share": share, "order": rec.order}
        if is_stem and bad_in:
            yield rule.finding(
                "info",
                rec.name,
                f"in_channels {m.in_channels} is not a multiple of {a} ({ctx.dtype})",
                f"pad the input images' channels {m.in_channels} -> 4",
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
        yield _misaligned(
            ctx,
            rule,
            rec,
            "channels",
            (m.in_channels, m.out_channels),
            (bad_in, bad_out),
            a,
            details={
                "in_channels": m.in_channels,
                "out_channels": m.out_channels,
                "alignment": a,
                "assumes": ctx.assumes,
            },
            **common,
        )


@_rule(
    "MP102",
    "conv-channels-small",
    "info",
    summary="Convolutions with fewer than 32 channels underuse tensor cores.",
    rationale=(
        "SURF's A100 guide asks for channel dims >= 32 whenever possible: a narrow convolution "
        "is memory-bound and fills only part of a tensor-core tile. Reported only for counts that "
        "are already aligned (MP101 reports the others), and always at info: narrow layers are "
        "often deliberate. The fix --measure times is zero-padding the channels to 32." + CPU_NOTE
    ),
    source=(
        "SURF, 'Deep Learning on A100 GPUs' (channel dim >= 32); NVIDIA Convolutional Layers guide "
        "(quantization effects)"
    ),
    tensor_core=True,
    mechanical=True,
)
def _conv_channels_small(ctx: LintContext) -> Iterator[Finding]:
    rule = SHAPE_RULES["MP102"]
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
        what, pad, remedy = _pad_plan(
            rec.name,
            "channels",
            (m.in_channels, m.out_channels),
            (MIN_CONV_CHANNELS if small_in else None, MIN_CONV_CHANNELS if small_out else None),
        )
        yield rule.finding(
            "info",
            rec.name,
            f"{what} below {MIN_CONV_CHANNELS}",
            f"widen to {MIN_CONV_CHANNELS} where the architecture allows (pad {pad})",
            shape=layer_shape(rec, conv_desc(m)),
            flops_share=ctx.share(rec.flops),
            order=rec.order,
            details={"in_channels": m.in_channels, "out_channels": m.out_channels, "assumes": ctx.assumes},
            remedy=remedy,
        )


@_rule(
    "MP103",
    "grouped-conv",
    "warning",
    summary="Grouped convolutions need equal in/out channels and a supported group width.",
    rationale=(
        "SURF's A100 guide: for grouped convolutions make in_channels equal out_channels and the "
        "channels per group one of {4, 8, 16, 32} (cuDNN 8.2) or {1, 4, 8, 16, 32, 64, 128, 256} (cuDNN "
        "8.3 and later; 1 is depthwise). Other grouped shapes run generic, much slower kernels. "
        "Warning from 1% of the model's FLOPs, info below." + CPU_NOTE
    ),
    source="SURF, 'Deep Learning on A100 GPUs' (grouped convolutions)",
    tensor_core=True,
)
def _grouped_conv(ctx: LintContext) -> Iterator[Finding]:
    rule = SHAPE_RULES["MP103"]
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
            shape=layer_shape(rec, conv_desc(m)),
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
        "model's FLOPs, info below." + CPU_NOTE
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
    rule = SHAPE_RULES["MP104"]
    if ctx.dtype == "fp8":
        return  # MP109 judges Linear layers under fp8: the consequence there is no fp8 at all
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
        shape = layer_shape(rec, f"Linear({m.in_features}, {m.out_features})")
        details = {"in_features": m.in_features, "out_features": m.out_features, "alignment": a}
        details["assumes"] = ctx.assumes
        if bad_out and rec.name == ctx.head and m.out_features < SMALL_HEAD:
            yield rule.finding(
                "info",
                rec.name,
                f"out_features {m.out_features} not a multiple of {a} ({ctx.dtype})",
                f"pad out_features {m.out_features} -> {_up(m.out_features, a)}",
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
        yield _misaligned(
            ctx,
            rule,
            rec,
            "features",
            (m.in_features, m.out_features),
            (bad_in, bad_out),
            a,
            shape=shape,
            flops_share=share,
            order=rec.order,
            details=details,
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
        "uses no tensor cores)." + CPU_NOTE
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
    rule = SHAPE_RULES["MP105"]
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
            shape=layer_shape(lin, f"{lin_name}: Linear({lin.module.in_features}, {vocab})"),
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
        "batch x height x width). Measure throughput before changing the batch size." + CPU_NOTE
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
    yield SHAPE_RULES["MP106"].finding(
        "info",
        None,
        f"batch size {b} is not a multiple of {a} ({ctx.dtype}); it is the M dimension of "
        f"{len(hit)} Linear layer{'s' if len(hit) > 1 else ''}",
        f"batch size {b} -> {_up(b, a)} (measure throughput: often no difference)",
        shape=f"{names[0]} input {dims(hit[0].input.shape) if hit[0].input else '?'}"
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
        "length, so the effect is usually small: info only." + CPU_NOTE
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
    yield SHAPE_RULES["MP107"].finding(
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
        "fp16/bf16 policies only." + CPU_NOTE
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
        yield SHAPE_RULES["MP108"].finding(
            "warning",
            call.module,
            f"attention head dim {d} " + ("exceeds 256" if d > 256 else "is not a multiple of 8"),
            f"choose embed_dim / num_heads = {target} (e.g. change the number of heads)",
            shape=f"{call.name} on " + ", ".join(dims(t.shape) for t in call.args[:3]),
            details={"head_dim": d},
        )


@_rule(
    "MP109",
    "fp8-linear-dims",
    "warning",
    summary="Under fp8, a Linear layer runs in fp8 only when in and out features are multiples of 16.",
    rationale=(
        "torch._scaled_mm, the fp8 matmul torchao's Float8Linear calls, needs both dimensions of "
        "every GEMM divisible by 16, so mixprec's fp8 policies convert only those Linear layers; "
        "any other stays in bf16 and gains nothing from fp8. Warning from 1% of the model's "
        "FLOPs, info below; fp32 islands are not judged." + CPU_NOTE
    ),
    source=(
        "torchao float8 README (dimensions divisible by 16); pytorch aten/src/ATen/native/cuda/Blas.cpp "
        "(_scaled_mm shape checks)"
    ),
    tensor_core=True,
    mechanical=True,
)
def _fp8_linear_dims(ctx: LintContext) -> Iterator[Finding]:
    if ctx.dtype != "fp8":
        return
    rule = SHAPE_RULES["MP109"]
    for rec in ctx.linears:
        m = rec.module
        if ctx.alignment_for(rec.name) is None:
            continue  # an fp32 island
        bad = (m.in_features % FP8_DIVISOR != 0, m.out_features % FP8_DIVISOR != 0)
        if not any(bad):
            continue
        sizes = (m.in_features, m.out_features)
        to = (_up(sizes[0], FP8_DIVISOR) if bad[0] else None, _up(sizes[1], FP8_DIVISOR) if bad[1] else None)
        what, pad, remedy = _pad_plan(rec.name, "features", sizes, to)
        share = ctx.share(rec.flops)
        yield rule.finding(
            ctx.share_severity(share),
            rec.name,
            f"{what} not a multiple of {FP8_DIVISOR}: this Linear stays in bf16 under {ctx.policy.name}",
            "pad " + pad,
            remedy=remedy,
            shape=layer_shape(rec, f"Linear({m.in_features}, {m.out_features})"),
            flops_share=share,
            order=rec.order,
            details={"in_features": m.in_features, "out_features": m.out_features, "alignment": FP8_DIVISOR},
        )


__all__ = ["GROUP_WIDTHS", "MIN_CONV_CHANNELS", "SHAPE_RULES", "SMALL_HEAD", "VOCAB_MULTIPLE"]
