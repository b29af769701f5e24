"""Model preparation written out in plain PyTorch, in the order :meth:`mixprec.Policy.prepare`
applies it: the fp32_precision knobs, fp32 islands, the fp8 conversion, the *-true cast with
BatchNorm kept fp32, channels_last and the input hooks; and the snippets that code needs."""

from __future__ import annotations

from mixprec.exports.facts import Facts
from mixprec.exports.text import DTYPE_CODE, DTYPE_SHORT, comment, indent, py


def precision_lines(facts: Facts, *, indent_by: int = 0, legacy_note: bool = True) -> list[str]:
    """The fp32_precision knob assignments, with the note about the legacy API."""
    text = f"fp32 math mode: {facts.math_mode()}."
    if legacy_note:
        text += (
            " The torch >= 2.9 fp32_precision API: do not also use the legacy allow_tf32 flags or"
            " torch.set_float32_matmul_precision(); once both APIs were used, reading either raises."
        )
    knobs = [f'torch.backends.{b}.{op}.fp32_precision = "{value}"' for b, op, value in facts.knobs()]
    return comment(text, indent_by) + indent(knobs, indent_by)


def helper_names(
    facts: Facts, *, casts: bool = True, channels_last_hook: bool = True, batch_norm: bool = True
) -> list[str]:
    """The snippets :func:`prepare_lines` uses for this policy."""
    names = []
    if facts.keep:
        names += ["fp32_islands", "keep_in_fp32"]
    if facts.fp8_recipe and facts.config.keep_bf16:
        names.append("matches_any")
    if facts.true is not None and casts:
        names.append("cast_inputs")
        if batch_norm:
            names.append("keep_batch_norm_fp32")
        if facts.keep:
            names.append("refuse_split_ties")
    if facts.channels_last and channels_last_hook:
        names.append("channels_last_inputs")
    return names


def prepare_lines(
    facts: Facts,
    *,
    move: bool,
    casts: bool = True,
    channels_last: bool = True,
    keep_kwargs: tuple[str, ...] = (),
    batch_norm: bool = True,
) -> list[str]:
    """Model preparation in plain PyTorch, in the order Policy.prepare() applies it.

    ``batch_norm``: keep BatchNorm fp32 after a *-true cast, as Policy.prepare() does (False where
    the stack then gathers every parameter of a group in one dtype: FSDP2's export).
    ``casts``: cast a *-true model and register the input cast (False where the stack does both);
    ``channels_last``: convert the model and its inputs here (False where it must happen later);
    ``keep_kwargs``: keyword inputs the input cast leaves alone (the HF Trainer's ``labels``).
    """
    lines = ["model = model.to(device_type)"] if move else []
    if facts.keep:
        lines.append(f"islands = fp32_islands(model, {py(facts.keep)})  # keep_fp32: module-name patterns")
    if facts.fp8_recipe:
        lines += fp8_lines(facts)
    if facts.true is not None and casts:
        if facts.keep:
            lines.append("refuse_split_ties(model, islands)  # a tied weight: fp32 on both sides or neither")
        lines.append(
            f"model = model.to({DTYPE_CODE[facts.true]})  # {DTYPE_SHORT[facts.true]} weights, no fp32"
            " master copy"
        )
        if facts.keep:
            lines += [
                "for module in islands.values():",
                "    module.float()  # fp32 islands keep fp32 weights",
            ]
        if batch_norm:
            lines.append("keep_batch_norm_fp32(model)  # its weights and running statistics stay fp32")
    if facts.channels_last and channels_last:
        lines.append("model = model.to(memory_format=torch.channels_last)")
    if facts.keep:
        back = f", output_dtype={DTYPE_CODE[facts.true]}" if facts.true is not None else ""
        lines += [
            "for module in islands.values():",
            f"    keep_in_fp32(module, device_type{back})  # outside autocast, fp32 inputs",
        ]
    if facts.true is not None and casts:
        keep = f", keep={tuple(keep_kwargs)!r}".replace("'", '"') if keep_kwargs else ""
        lines.append(
            f"model.register_forward_pre_hook(cast_inputs({DTYPE_CODE[facts.true]}{keep}), with_kwargs=True)"
        )
    if facts.channels_last and channels_last:
        lines.append("model.register_forward_pre_hook(channels_last_inputs, with_kwargs=True)")
    return lines


def fp8_lines(facts: Facts) -> list[str]:
    """torchao's conversion of the Linear layers whose dimensions torch._scaled_mm takes (both
    divisible by 16), fp32 islands and the precision map's layers left out: what Policy.prepare()
    converts."""
    island = []
    if facts.keep:
        island += [
            '    if any(name == k or name.startswith(k + ".") for k in islands):',
            "        return False  # fp32 islands stay fp32",
        ]
    if facts.config.keep_bf16:
        island += [
            f"    if matches_any(name, {py(list(facts.config.keep_bf16))}):",
            "        return False  # the precision map (keep_bf16): stays in bf16 under autocast",
        ]
    return [
        "",
        "",
        "def fp8_eligible(module, name):",
        "    if type(module) is not torch.nn.Linear:",
        "        return False",
        *island,
        "    if module.weight.dtype != torch.float32:",
        "        return False  # a float64 or half Linear keeps computing in its own dtype",
        "    return module.in_features % 16 == 0 and module.out_features % 16 == 0  # torch._scaled_mm",
        "",
        "",
        "convert_to_float8_training(",
        "    model,",
        f"    config=Float8LinearConfig.from_recipe_name({py(facts.fp8_recipe)}),",
        "    module_filter_fn=fp8_eligible,",
        ")  # Linear layers -> torchao Float8Linear: fp8 matmuls with dynamic scales",
    ]
