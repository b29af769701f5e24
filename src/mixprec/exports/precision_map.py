"""A low-format policy's precision map (``keep_bf16``) written for the stack that trains with it.

The low-format Linear policies (fp8-rowwise, fp8-tensorwise, mxfp8, nvfp4) keep some Linear layers,
or single GEMM directions of them, in bf16 (:mod:`mixprec.policy.lowformat`). :func:`render`
resolves the map against the model's concrete Linear names (globs become the exact names
:func:`~mixprec.policy.lowformat.plan_layers` gives) and writes it in the form each stack of
:data:`MAP_TARGETS` takes:

- ``torchao``: Python. fp8: ``convert_to_float8_training`` with a ``module_filter_fn`` that converts
  exactly the map's layers; mxfp8: those ``nn.Linear`` swapped for torchao's ``MXFP8Linear``
  (``wgrad_with_hp=True`` for a ``:wgrad`` entry); nvfp4: ``quantize_`` with
  ``NVFP4TrainingConfig`` and a ``filter_fn``.
- ``torchtitan``: TOML for the releases configured by TOML (v0.2.x): ``[quantize.linear.float8]``
  or ``[quantize.linear.mx]`` with ``filter_fqns`` (a substring match that *skips* modules).
- ``accelerate``: Python, fp8 only: ``AORecipeKwargs(config=..., module_filter_func=...)``.
- ``megatron``: YAML for Megatron-LM's ``--te-precision-config-file`` (``configs`` + ``matchers``).
- ``transformer-engine``: Python: the map's layers as ``te.Linear`` under a TE recipe.

Every text starts with a ``#`` header: the policy, the map as given and resolved, the share of the
Linear layers (and of their GEMM work) in the format, and what the target cannot express. Where a
target cannot express the map it is refused, never approximated: :class:`MapRefused` names the
entry or format, why, and the targets that can express it. Pure text: nothing is imported from the
target stacks.
"""

from __future__ import annotations

import fnmatch
import json
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from mixprec.errors import ExportRefused, PolicyError, UsageError, did_you_mean
from mixprec.policy.blockscale import DIRECTIONS
from mixprec.policy.lowformat import LayerPlan, parse_entry, plan_layers, refuse_unmatched, validate_map
from mixprec.policy.registry import POLICIES, PolicySpec, canonical_name

__all__ = ["MAP_TARGETS", "MapRefused", "render"]

MAP_TARGETS: tuple[str, ...] = ("torchao", "torchtitan", "accelerate", "megatron", "transformer-engine")
LOW_FORMAT_POLICIES: tuple[str, ...] = tuple(n for n, s in POLICIES.items() if s.low_format is not None)

WIDTH = 100
# What each GEMM direction is, for the texts.
_GEMM = {"forward": "forward GEMM", "dgrad": "input-gradient GEMM (dgrad)", "wgrad": "weight-gradient GEMM"}
# torch._scaled_mm's divisor, which torchtitan's module_filter_fn applies to every format.
_TITAN_DIVISOR = 16
# torchao's NVFP4 Triton GEMM (nvfp4_mm_triton) needs M, K and N all multiples of 128.
_NVFP4_TORCHAO_DIVISOR = 128


class MapRefused(ExportRefused):
    """A target cannot express a precision map faithfully. ``entry`` is the ``keep_bf16`` entry (or the
    Linear) it cannot express, None where the format itself is the reason; ``alternative`` names the
    targets that can (or what to change where none can)."""

    exit_code = 2

    def __init__(
        self, target: str, policy: str, fmt: str, entry: str | None, reason: str, alternative: str
    ) -> None:
        UsageError.__init__(
            self,
            f"Cannot write the {fmt} precision map of {policy!r} for {target}: {reason}. "
            f"Instead: {alternative}.",
        )
        self.target = target
        self.policy = policy
        self.device = "any"
        self.format = fmt
        self.entry = entry
        self.reason = reason
        self.alternative = alternative


@dataclass(frozen=True)
class _Refusal:
    entry: str | None
    reason: str
    hint: str = ""  # what to change in the map, before the list of targets that can express it


@dataclass(frozen=True)
class _Map:
    """A precision map resolved against one model."""

    policy: str
    spec: PolicySpec
    fmt: str
    entries: tuple[str, ...]
    plan: LayerPlan
    shapes: dict[str, tuple[int, int]]  # every nn.Linear (subclasses too) -> (in, out)
    islands: tuple[str, ...]  # Linear layers in keep_fp32 islands

    @property
    def partial(self) -> dict[str, frozenset[str]]:
        """Converted layers with some direction kept in bf16 -> the directions kept."""
        return {n: frozenset(DIRECTIONS) - d for n, d in self.plan.low.items() if d != frozenset(DIRECTIONS)}

    def entry_for(self, layer: str, direction: str) -> str:
        """The map entry that keeps ``layer``'s ``direction`` in bf16."""
        for entry in self.entries:
            pattern, d = parse_entry(entry)
            if d == direction and fnmatch.fnmatchcase(layer, pattern):
                return entry
        return f"{layer}:{direction}"  # unreachable: plan_layers only drops what an entry names

    def left(self) -> list[str]:
        """Every Linear outside the format (kept, ineligible, in an fp32 island), in model order."""
        return [n for n in self.shapes if n not in self.plan.low]


def _resolve(policy: str, model: nn.Module, keep_bf16: Sequence[str], keep_fp32: Sequence[str]) -> _Map:
    name = canonical_name(policy)
    spec = POLICIES[name]
    if spec.low_format is None:
        raise PolicyError(
            f"A precision map belongs to a low-format Linear policy ({', '.join(LOW_FORMAT_POLICIES)}); "
            f"{name!r} runs no Linear in a low format."
        )
    entries = validate_map(spec, keep_bf16)
    refuse_unmatched(model, entries)
    shapes = {
        n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    if "" in shapes:
        raise UsageError(
            "The model is itself a Linear layer: a precision map names layers inside a model. Wrap it "
            "(e.g. nn.Sequential(linear)) and name the layer '0'."
        )
    plan = plan_layers(model, spec, keep_fp32, entries)
    placed = {*plan.low, *plan.kept, *plan.ineligible}
    islands = tuple(n for n in shapes if n not in placed)
    return _Map(name, spec, str(spec.low_format), entries, plan, shapes, islands)


# ------------------------------------------------------------------------------------ refusals
def _first_partial(m: _Map, allowed: Callable[[frozenset[str]], bool]) -> tuple[str, str, str] | None:
    """(entry, layer, direction) of the first direction entry whose layer's kept set is not allowed."""
    for layer, kept in m.partial.items():
        if not allowed(kept):
            direction = next(d for d in DIRECTIONS if d in kept)
            return m.entry_for(layer, direction), layer, direction
    return None


def _whole_layer_hint(layer: str) -> str:
    return f"keep the whole layer in bf16 (entry {layer!r})"


def _refuse_directions(m: _Map, why: str) -> _Refusal | None:
    found = _first_partial(m, lambda kept: False)
    if found is None:
        return None
    entry, layer, direction = found
    return _Refusal(
        entry,
        f"keep_bf16 entry {entry!r} keeps only {layer}'s {_GEMM[direction]} in bf16; {why}",
        _whole_layer_hint(layer),
    )


def _torchao(m: _Map) -> _Refusal | None:
    if m.fmt == "mxfp8":
        found = _first_partial(m, lambda kept: kept == {"wgrad"})
        if found is not None:
            entry, layer, _ = found
            kept = sorted(m.partial[layer])
            return _Refusal(
                entry,
                f"keep_bf16 entry {entry!r} keeps {layer}'s {', '.join(_GEMM[d] for d in kept)} in bf16; "
                "torchao's MXFP8Linear always runs the forward and dgrad GEMMs in MXFP8 and can keep only "
                "the weight-gradient GEMM in high precision (wgrad_with_hp)",
                _whole_layer_hint(layer),
            )
    if m.fmt == "nvfp4":
        refused = _refuse_directions(
            m,
            "torchao's NVFP4Linear runs all three GEMMs in NVFP4 (NVFP4TrainingConfig has no "
            "per-GEMM option)",
        )
        if refused is not None:
            return refused
        for layer in m.plan.low:
            k, n = m.shapes[layer]
            if k % _NVFP4_TORCHAO_DIVISOR or n % _NVFP4_TORCHAO_DIVISOR:
                return _Refusal(
                    layer,
                    f"Linear {layer} ({k} -> {n}) runs in NVFP4 under mixprec's map, but torchao's NVFP4 "
                    f"GEMM (nvfp4_mm_triton) needs every dimension a multiple of {_NVFP4_TORCHAO_DIVISOR}",
                    f"keep it in bf16 (add {layer!r} to keep_bf16)",
                )
    return None


def _torchtitan(m: _Map) -> _Refusal | None:
    if m.fmt == "nvfp4":
        return _Refusal(
            None,
            "no torchtitan release configured by TOML has an NVFP4 converter (v0.2.2, the last, has "
            "quantize.linear.float8 and quantize.linear.mx only); the NVFP4 converter torchtitan added "
            "after moving to Python configs selects the layers to convert by substring ('fqns', every "
            "Linear when empty) and cannot switch single GEMMs (its nvfp4.md)",
        )
    refused = _refuse_directions(
        m, "torchtitan converts a Linear whole, with one recipe for the model (filter_fqns names modules)"
    )
    if refused is not None:
        return refused
    for skipped in _titan_filter(m):
        for converted in m.plan.low:
            if skipped in converted:
                return _Refusal(
                    skipped,
                    f"torchtitan's filter_fqns skips every Linear whose FQN contains an entry, and the "
                    f"kept layer {skipped!r} is a substring of the converted layer {converted!r}, which "
                    "torchtitan would skip too",
                    "rename one of the modules",
                )
    return None


def _accelerate(m: _Map) -> _Refusal | None:
    if m.fmt == "fp8":
        return None
    directions = ""
    if m.partial:
        layer, kept = next(iter(m.partial.items()))
        entry = m.entry_for(layer, next(d for d in DIRECTIONS if d in kept))
        directions = (
            f"; and keep_bf16 entry {entry!r} is one GEMM of one layer, while Accelerate's per-GEMM switch, "
            "TERecipeKwargs(override_linear_precision=(fprop, dgrad, wgrad)), applies to every layer at "
            "once (and to Transformer Engine's recipe only)"
        )
    return _Refusal(
        None,
        f"Accelerate 1.15's torchao backend (AORecipeKwargs) converts Linear layers to torchao's fp8 "
        f"Float8Linear only; it has no {m.fmt} recipe (MXFP8 only through Transformer Engine, "
        f"TERecipeKwargs(use_mxfp8_block_scaling=True), for every layer at once; NVFP4 not at all)"
        f"{directions}",
    )


_TE_FP8_RECIPES = (
    "Float8CurrentScaling (per tensor), Float8BlockScaling (1x128/128x128 blocks), MXFP8BlockScaling"
)


def _te_like(m: _Map, stack: str) -> _Refusal | None:
    if m.spec.fp8_recipe == "rowwise":
        return _Refusal(
            None,
            f"torchao's rowwise fp8 recipe (one power-of-two scale per row, e4m3 gradients) has no "
            f"counterpart in {stack}'s recipes ({_TE_FP8_RECIPES}, delayed scaling)",
            "use fp8-tensorwise (Float8CurrentScaling)",
        )
    return _refuse_directions(
        m,
        f"{stack} picks one recipe per module (its backward_override keeps dgrad and wgrad together, for "
        "every module under the recipe)",
    )


_CHECKS: dict[str, Callable[[_Map], _Refusal | None]] = {
    "torchao": _torchao,
    "torchtitan": _torchtitan,
    "accelerate": _accelerate,
    "megatron": lambda m: _te_like(m, "Megatron-LM (through Transformer Engine)"),
    "transformer-engine": lambda m: _te_like(m, "Transformer Engine"),
}


def _refuse(m: _Map, target: str) -> None:
    refused = _CHECKS[target](m)
    if refused is None:
        return
    others = [t for t in MAP_TARGETS if t != target and _CHECKS[t](m) is None]
    can = (
        f"the {' or '.join(others)} target{'s' if len(others) > 1 else ''} can express this map"
        if others
        else "no target here expresses this map; mixprec's own policy (the `mixprec` export) runs it"
    )
    alternative = f"{refused.hint}; or {can}" if refused.hint else can
    raise MapRefused(target, m.policy, m.fmt, refused.entry, refused.reason, alternative)


# ------------------------------------------------------------------------------------- header
def _share(m: _Map) -> str:
    work = {n: k * o for n, (k, o) in m.shapes.items()}
    total = 3 * sum(work.values()) or 1
    low = sum(len(d) * work[n] for n, d in m.plan.low.items())
    gemms = sum(len(d) for d in m.plan.low.values())
    return (
        f"{len(m.plan.low)} of {len(m.shapes)} Linear layers run in {m.fmt}; {gemms} of "
        f"{3 * len(m.shapes)} Linear GEMMs, {100.0 * low / total:.1f}% of the Linear GEMM work "
        "(in_features x out_features per token)"
    )


def _layer_label(m: _Map, name: str) -> str:
    kept = frozenset(DIRECTIONS) - m.plan.low[name]
    return f"{name} (all but {'/'.join(d for d in DIRECTIONS if d in kept)})" if kept else name


def _header(m: _Map, target: str, checked: str, cannot: Sequence[str], notes: Sequence[str]) -> str:
    spec = m.spec
    resolved = [
        f"in {m.fmt}: {', '.join(_layer_label(m, n) for n in m.plan.low) or 'none'}",
        f"kept in bf16 by the map: {', '.join(m.plan.kept) or 'none'}",
    ]
    if m.plan.ineligible:
        resolved.append(f"bf16, shapes the format's kernels cannot take: {', '.join(m.plan.ineligible)}")
    if m.islands:
        resolved.append(f"fp32 islands (keep_fp32): {', '.join(m.islands)}")
    parts = [
        f"mixprec precision map for {target}",
        f"policy: {m.policy}: {spec.description}",
        f"map (keep_bf16): {json.dumps(list(m.entries))}",
        *(f"resolved: {line}" for line in resolved),
        f"share: {_share(m)}",
        f"checked against: {checked}",
        *(f"cannot express: {line}" for line in cannot),
        *notes,
    ]
    lines: list[str] = []
    for part in parts:
        lines.extend(textwrap.wrap(part, WIDTH - 2, subsequent_indent="  ", break_on_hyphens=False))
    return "\n".join(f"# {line}" for line in lines) + "\n"


def _py_set(name: str, names: Sequence[str], comment: str) -> str:
    body = "".join(f"        {json.dumps(n)},\n" for n in names)
    return f"# {comment}\n{name} = frozenset(\n    [\n{body}    ]\n)\n"


# -------------------------------------------------------------------------------------- texts
# The torchao mxfp8 text; @LAYERS@ becomes the dict's rows.
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

_AUTOCAST_NOTE = (
    "train as the policy does: fp32 weights, the forward under torch.autocast('cuda', "
    "dtype=torch.bfloat16), so every Linear outside the format runs in bf16"
)


def _torchao_text(m: _Map) -> tuple[list[str], list[str], str]:
    if m.fmt == "fp8":
        recipe = str(m.spec.fp8_recipe)
        body = (
            "from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n\n"
            + _py_set(
                "FP8_LAYERS",
                list(m.plan.low),
                "The Linear layers the map runs in fp8; every other Linear stays.",
            )
            + f"\nconfig = Float8LinearConfig.from_recipe_name({json.dumps(recipe)})\n"
            "model = convert_to_float8_training(\n"
            "    model, config=config, module_filter_fn=lambda module, fqn: fqn in FP8_LAYERS\n"
            ")\n"
        )
        cannot = [
            "single GEMM directions (Float8Linear takes one recipe per layer; mixprec refuses them too)"
        ]
        notes = [
            "fill in: `model` (built, on its device, before the optimizer); " + _AUTOCAST_NOTE,
            "torch._scaled_mm needs both dimensions of a layer multiples of 16 (mixprec leaves the others "
            "out of the map already) and an fp8 GPU (compute capability >= 8.9)",
        ]
        return cannot, notes, body
    if m.fmt == "mxfp8":
        rows = []
        for name, low in m.plan.low.items():
            hp = "wgrad" not in low
            comment = f"  # keep_bf16 {m.entry_for(name, 'wgrad')!r}" if hp else ""
            rows.append(f"    {json.dumps(name)}: {hp},{comment}\n")
        body = _MXFP8_TEXT.replace("@LAYERS@", "".join(rows))
        cannot = [
            "a kept forward or dgrad GEMM (MXFP8Linear always runs both in MXFP8; refused)",
            "a ':wgrad' entry exactly: torchao's high-precision wgrad multiplies the operands in their own "
            "dtype (fp32 where the layer's input is fp32), where mixprec rounds both to bf16",
        ]
        notes = [
            "fill in: `model` (built, on its device); " + _AUTOCAST_NOTE,
            "kernel_preference AUTO needs a Blackwell GPU (sm100); KernelPreference.EMULATED runs "
            "anywhere and matches mixprec's MXFP8 emulation bit for bit",
        ]
        return cannot, notes, body
    body = (
        "import torch\n"
        "from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig\n"
        "from torchao.quantization import quantize_\n\n"
        + _py_set(
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
    cannot = [
        "single GEMM directions (NVFP4Linear runs all three in NVFP4; refused)",
        "mixprec's random bits: NVFP4Linear draws its own Hadamard signs and stochastic-rounding "
        "seeds, so it runs the same recipe, not the same numbers",
    ]
    notes = [
        "fill in: `model` (built, on its device); " + _AUTOCAST_NOTE,
        "torchao's NVFP4 GEMM needs a Blackwell GPU with Triton, bf16 activations (it casts) and every "
        "dimension a multiple of 128, the tokens per GEMM (batch x sequence) included",
    ]
    return cannot, notes, body


def _titan_filter(m: _Map) -> list[str]:
    """The Linear layers torchtitan would convert (dimensions multiples of 16) but the map keeps out
    of the format (kept, ineligible, fp32 islands): its filter_fqns."""
    return [n for n in m.left() if all(d % _TITAN_DIVISOR == 0 for d in m.shapes[n])]


def _toml_list(names: Sequence[str], comments: dict[str, str]) -> str:
    rows = "".join(f"    {json.dumps(n)},{'  # ' + comments[n] if n in comments else ''}\n" for n in names)
    return f"[\n{rows}]" if names else "[]"


def _torchtitan_text(m: _Map) -> tuple[list[str], list[str], str]:
    section, recipe = ("float8", str(m.spec.fp8_recipe)) if m.fmt == "fp8" else ("mx", "mxfp8_cublas_rceil")
    skipped = _titan_filter(m)
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
    cannot = [
        "single GEMM directions (refused); exact names: filter_fqns is a substring match (a kept FQN "
        "inside a converted one is refused)",
    ]
    notes = [
        "torchtitan v0.2.x (configured by TOML; later releases take Python configs): the FQNs are those "
        "of your torchtitan model, which must be the model this map was resolved on",
        "filter_fqns lists every Linear the map keeps out of the format whose dimensions are multiples "
        "of 16 (torchtitan skips the others itself); it replaces torchtitan's default",
    ]
    if m.fmt == "mxfp8":
        notes.append(
            "recipe mxfp8_cublas_rceil: RCEIL scales as mixprec's MXFP8 (plain mxfp8_cublas rounds its "
            "scales down, FLOOR); torchtitan v0.2.x builds it with torchao's MXLinearConfig, which torchao "
            "0.17 removed: use torchao <= 0.16; needs a Blackwell GPU"
        )
    else:
        notes.append("needs an fp8 GPU (compute capability >= 8.9), or float8.emulate = true to test")
    return cannot, notes, body


def _accelerate_text(m: _Map) -> tuple[list[str], list[str], str]:
    recipe = str(m.spec.fp8_recipe)
    body = (
        "import torch\n"
        "from accelerate import Accelerator\n"
        "from accelerate.utils import AORecipeKwargs\n"
        "from torchao.float8 import Float8LinearConfig\n\n"
        + _py_set(
            "FP8_LAYERS", list(m.plan.low), "The Linear layers the map runs in fp8; every other Linear stays."
        )
        + "\n\ndef module_filter_func(module: torch.nn.Module, fqn: str) -> bool:\n"
        '    """Exactly the map\'s layers (Accelerate\'s default would skip the first and last Linear)."""\n'
        "    return fqn in FP8_LAYERS\n\n\n"
        "fp8_kwargs = AORecipeKwargs(\n"
        f"    config=Float8LinearConfig.from_recipe_name({json.dumps(recipe)}),\n"
        "    module_filter_func=module_filter_func,\n"
        ")\n"
        'accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[fp8_kwargs])\n'
        "model, optimizer = accelerator.prepare(model, optimizer)  # converts FP8_LAYERS to Float8Linear\n"
    )
    cannot = ["single GEMM directions (the fp8 policies have none; TERecipeKwargs' override is global)"]
    notes = [
        "fill in: `model`, `optimizer`; Accelerate runs the forward under bf16 autocast for fp8",
        "on a GPU below compute capability 8.9 Accelerate switches mixed_precision='fp8' to fp16 with only "
        "a warning: run on an fp8 GPU",
    ]
    return cannot, notes, body


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


def _megatron_text(m: _Map) -> tuple[list[str], list[str], str]:
    if m.fmt == "nvfp4":
        recipe: dict[str, object] = {"fp4_quantization_recipe": "nvfp4"}
        flags = "--fp4-format e2m1 --fp4-recipe nvfp4"
    elif m.fmt == "mxfp8":
        recipe = {"fp8_quantization_recipe": "mxfp8", "fp8_format": "e4m3"}
        flags = "--fp8-format e4m3 --fp8-recipe mxfp8"
    else:
        recipe = {"fp8_quantization_recipe": "tensorwise", "fp8_format": "hybrid"}
        flags = "--fp8-format hybrid --fp8-recipe tensorwise"
    recipe["override_nonquantized_autocast"] = True
    matchers: dict[str, object] = {}
    for i, name in enumerate(m.left()):
        matchers[f"bf16_{i}"] = {
            "config": "bf16",
            "type": "glob",
            "pattern": _glob_literal(name),
            "enabled": True,
        }
    for i, name in enumerate(m.plan.low):
        matchers[f"{m.fmt}_{i}"] = {
            "config": m.fmt,
            "type": "glob",
            "pattern": _glob_literal(name),
            "enabled": True,
        }
    tea = "TEQuantizationParams"
    data = {
        "configs": {
            "bf16": {"transformer_engine_config_type": tea, "training_recipe": {}},
            m.fmt: {"transformer_engine_config_type": tea, "training_recipe": recipe},
        },
        "matchers": matchers,
    }
    body = _yaml_block(data)
    cannot = ["single GEMM directions (refused)"] + (
        [] if m.fmt != "fp8" else ["fp8-rowwise (refused): Megatron's fp8 recipes have no per-row scaling"]
    )
    notes = [
        f"run: pretrain_gpt.py ... {flags} --te-precision-config-file precision_map.yaml; the patterns "
        "are your Megatron model's module paths (matched with fnmatch, first matcher wins), which must be "
        "the names this map was resolved on; modules that are no Transformer Engine layer are never "
        "quantized",
        "written from Megatron-LM's source (megatron/core/quantization/quant_config.py, "
        "TEQuantizationParams in megatron/core/extensions/transformer_engine.py, 2026-08); Megatron-LM "
        "is not installed here: checked by parsing and schema only, never run",
    ]
    return cannot, notes, body


def _te_text(m: _Map) -> tuple[list[str], list[str], str]:
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
        + _py_set("TE_LAYERS", list(m.plan.low), f"The Linear layers the map runs in {m.fmt}.")
        + "\n\ndef to_te(linear: torch.nn.Linear) -> te.Linear:\n"
        '    """A te.Linear holding a copy of `linear`\'s parameters (build the optimizer after this)."""\n'
        "    new = te.Linear(\n"
        "        linear.in_features,\n"
        "        linear.out_features,\n"
        "        bias=linear.bias is not None,\n"
        "        params_dtype=linear.weight.dtype,\n"
        "        device=linear.weight.device,\n"
        "    )\n"
        "    with torch.no_grad():\n"
        "        new.weight.copy_(linear.weight)\n"
        "        if linear.bias is not None:\n"
        "            new.bias.copy_(linear.bias)\n"
        "    return new\n\n\n"
        "for name in TE_LAYERS:\n"
        '    parent_name, _, child = name.rpartition(".")\n'
        "    parent = model.get_submodule(parent_name)\n"
        "    setattr(parent, child, to_te(getattr(parent, child)))\n\n"
        "# each step (TE < 2.9: te.fp8_autocast(enabled=True, fp8_recipe=recipe)):\n"
        '#   with torch.autocast("cuda", dtype=torch.bfloat16), te.autocast(recipe=recipe):\n'
        "#       loss = loss_fn(model(batch), target)\n"
    )
    cannot = [
        "single GEMM directions (refused): TE has one recipe per autocast region; only its experimental "
        "CustomRecipe (quantizer factories per module name and tensor role) could express them"
    ] + ([] if m.fmt != "fp8" else ["fp8-rowwise (refused): TE has no per-row fp8 recipe"])
    notes = [
        "fill in: `model` (on the GPU), then the optimizer, `loss_fn`, `batch`",
        "written from Transformer Engine's source (transformer_engine/common/recipe/__init__.py, "
        "te.autocast in transformer_engine/pytorch/quantization.py, v2.18 era); TE is not installed "
        "here: checked by parsing only, never run",
    ]
    return cannot, notes, body


_TEXTS: dict[str, Callable[[_Map], tuple[list[str], list[str], str]]] = {
    "torchao": _torchao_text,
    "torchtitan": _torchtitan_text,
    "accelerate": _accelerate_text,
    "megatron": _megatron_text,
    "transformer-engine": _te_text,
}
_CHECKED = {
    "torchao": "torchao 0.18 (executed in mixprec's tests)",
    "torchtitan": "torchtitan v0.2.2 source (TOML schema, module_filter_fn); parsed, not run",
    "accelerate": "accelerate 1.15 with torchao 0.18 (executed in mixprec's tests)",
    "megatron": "Megatron-LM source, 2026-08 (read, not run)",
    "transformer-engine": "Transformer Engine source, 2026-08 (read, not run)",
}


def _check_target(target: str) -> str:
    key = target.strip().lower() if isinstance(target, str) else target
    if key not in MAP_TARGETS:
        raise UsageError(
            f"Unknown precision-map target {target!r}; valid: {', '.join(MAP_TARGETS)}."
            f"{did_you_mean(str(target), MAP_TARGETS)}"
        )
    return str(key)


def render(
    policy: str,
    model: nn.Module,
    keep_bf16: Sequence[str],
    target: str,
    *,
    keep_fp32: Sequence[str] = (),
) -> str:
    """The precision map ``keep_bf16`` of the low-format policy ``policy`` on ``model``, written for
    ``target`` (one of :data:`MAP_TARGETS`) with the model's exact Linear names.

    ``keep_fp32``: the candidate's fp32 islands (their Linear layers stay out of the format).
    Raises :class:`~mixprec.errors.PolicyError` for a policy without a low format or a map entry
    that is invalid or names no Linear of the model, :class:`~mixprec.errors.UsageError` for an
    unknown target, and :class:`MapRefused` (a UsageError) where the target cannot express the map.
    """
    key = _check_target(target)
    resolved = _resolve(policy, model, keep_bf16, keep_fp32)
    _refuse(resolved, key)
    cannot, notes, body = _TEXTS[key](resolved)
    return _header(resolved, key, _CHECKED[key], cannot, notes) + "\n" + body
