"""Low-format Linear policies (fp8, MXFP8, NVFP4): which Linear GEMMs run in the low format, the
precision map that keeps some in bf16, and the conversion.

A precision map (``keep_bf16``) is a list of entries ``"<module glob>"`` (the Linear's three
GEMMs stay in bf16) or ``"<module glob>:<direction>"`` with a direction of
:data:`~mixprec.policy.blockscale.DIRECTIONS` (only that GEMM does: ``"lm_head:wgrad"``). What
it leaves runs in bf16 under the policy's autocast, as every recipe in the field keeps its
excluded layers (torchao's ``module_filter_fn``, Megatron's ``--first-last-layers-bf16``).
Directions need a block format: torchao's Float8Linear takes one recipe per layer.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from mixprec.errors import PolicyError
from mixprec.policy.blockscale import BLOCK_FORMATS, DIRECTIONS, BlockFormat, BlockLinear, eligible, seed_of
from mixprec.policy.islands import is_fp32_island
from mixprec.policy.registry import PolicySpec


def parse_entry(entry: str) -> tuple[str, str | None]:
    """``"h.0.mlp:wgrad"`` -> ("h.0.mlp", "wgrad"); ``"head"`` -> ("head", None)."""
    pattern, sep, direction = entry.rpartition(":")
    if not sep:
        return entry, None
    if direction not in DIRECTIONS or not pattern:
        raise PolicyError(
            f"keep_bf16 entry {entry!r}: {direction!r} is not a GEMM direction; valid: a module glob, or "
            f"'<module glob>:<direction>' with a direction of {', '.join(DIRECTIONS)} (e.g. 'lm_head:wgrad')."
        )
    return pattern, direction


def validate_map(spec: PolicySpec, keep_bf16: Iterable[str]) -> tuple[str, ...]:
    """``keep_bf16`` as a tuple, checked against the policy; PolicyError naming the fix otherwise."""
    entries = (keep_bf16,) if isinstance(keep_bf16, str) else keep_bf16
    if not isinstance(entries, (list, tuple)) or not all(isinstance(e, str) and e for e in entries):
        raise PolicyError(
            f"keep_bf16 must be a list of Linear names or globs, optionally with ':forward', ':dgrad' or "
            f"':wgrad', got {keep_bf16!r}."
        )
    entries = tuple(entries)
    if entries and spec.low_format is None:
        raise PolicyError(
            f"keep_bf16={list(entries)!r} is a precision map for the low-format Linear policies (fp8-*, "
            f"mxfp8, nvfp4); {spec.name!r} runs no Linear in a low format. Drop keep_bf16, or use keep_fp32."
        )
    for entry in entries:
        _, direction = parse_entry(entry)
        if direction is not None and spec.block_format is None:
            raise PolicyError(
                f"keep_bf16 entry {entry!r}: {spec.name} converts a Linear whole (torchao's Float8Linear "
                "takes one recipe per layer); name the module without ':<direction>', or use mxfp8/nvfp4, "
                "whose GEMM directions mixprec sets one by one."
            )
    return entries


@dataclass
class LayerPlan:
    """Which Linear GEMMs a low-format policy runs in the format.

    Attributes:
        low: Linear name -> the directions it runs in the format (at least one).
        kept: Linear names the precision map keeps whole in bf16.
        ineligible: Linear names the format's kernels cannot take (a dimension not a multiple of its
            block, fp8: of 16; weights not fp32); they run as they would without the format.
    """

    low: dict[str, frozenset[str]] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    ineligible: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    """Each ineligible Linear's :func:`refusal`: why the kernels cannot take it, and the fix."""

    def describe(self) -> list[str]:
        """The map as ``keep_bf16`` entries: whole layers, then single directions."""
        partial = [f"{n}:{d}" for n, dirs in self.low.items() for d in DIRECTIONS if d not in dirs]
        return [*self.kept, *partial]


def _eligible(module: nn.Module, spec: PolicySpec) -> bool:
    """Whether the format's kernels take the Linear: its shape, and fp32 weights (a float64, half or
    complex Linear computes in its own dtype, which a low format would silently change)."""
    if parametrize.is_parametrized(module):  # (before a read of its weight, which runs the parametrization)
        return False
    if getattr(module, "weight", None) is None or module.weight.dtype != torch.float32:
        return False
    if spec.block_format is not None:
        return eligible(module, BLOCK_FORMATS[spec.block_format])
    from mixprec.policy.fp8 import fp8_eligible

    return fp8_eligible(module)


def refusal(module: nn.Module, spec: PolicySpec) -> str:
    """Why ``spec``'s kernels cannot take the Linear ``module``, with the fix, in a few words (''
    where they can): what a report names when a format converts none of a model's layers."""
    if _eligible(module, spec):
        return ""
    if parametrize.is_parametrized(module):
        return (
            "its weight is computed by a parametrization (spectral_norm, weight_norm), which the "
            f"format's kernels cannot run: {spec.name} converts a Linear's own stored weight"
        )
    weight = getattr(module, "weight", None)
    if weight is None or weight.dtype != torch.float32:
        dtype = str(weight.dtype).removeprefix("torch.") if weight is not None else "absent"
        return f"its weight is {dtype}: the format takes fp32 master weights (train them in fp32)"
    if type(module) is not nn.Linear:
        return f"a {type(module).__name__}, not a plain torch.nn.Linear: {spec.name} converts only those"
    from mixprec.policy.fp8 import FP8_DIVISOR

    multiple = BLOCK_FORMATS[spec.block_format].block if spec.block_format is not None else FP8_DIVISOR
    sizes = {"in_features": module.in_features, "out_features": module.out_features}
    odd = [f"{k} {v}" for k, v in sizes.items() if v % multiple]
    return f"{' and '.join(odd)} not a multiple of {multiple}: pad {'them' if len(odd) > 1 else 'it'} to one"


def none_converted(spec: PolicySpec, refused: dict[str, str], model: str = "the model") -> str:
    """One line: ``spec`` converts none of ``model``'s Linear layers, naming the first its kernels
    cannot take and the fix (``refused``: a LayerPlan's)."""
    if not refused:
        return f"{spec.name} converts torch.nn.Linear layers, and {model} runs none outside fp32 islands"
    name, why = next(iter(refused.items()))
    more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    return f"{spec.name} can take no Linear layer of {model}: {name!r}: {why}{more}"


def plan_layers(
    model: nn.Module, spec: PolicySpec, keep_fp32: Iterable[str] = (), keep_bf16: Iterable[str] = ()
) -> LayerPlan:
    """The model's Linear layers under ``spec`` and the precision map ``keep_bf16``; layers in fp32
    islands are in no list (they run in fp32 by design)."""
    islands = tuple(keep_fp32)
    entries = validate_map(spec, tuple(keep_bf16))
    if isinstance(model, nn.Linear):
        # the conversion swaps a Linear in its parent, and the model itself has none
        raise PolicyError(
            f"{spec.name} converts Linear layers inside a model, and this model is a bare "
            f"{type(model).__name__}; wrap it (torch.nn.Sequential(linear)) and prepare the wrapper."
        )
    plan = LayerPlan()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or is_fp32_island(name, islands):
            continue
        why = refusal(module, spec)
        if why:
            plan.ineligible.append(name)
            plan.refused[name] = why
            continue
        low = low_directions(name, entries)
        if low:
            plan.low[name] = low
        else:
            plan.kept.append(name)
    return plan


def low_directions(name: str, keep_bf16: Iterable[str], runs: Iterable[str] = DIRECTIONS) -> frozenset[str]:
    """The GEMM directions of Linear ``name`` (of those it ``runs``) that the map ``keep_bf16``
    leaves in the low format: an entry naming the layer whole takes them all, one with a direction
    takes that one."""
    low = set(runs)
    for entry in keep_bf16:
        pattern, direction = parse_entry(entry)
        if fnmatch.fnmatchcase(name, pattern):
            low -= low.copy() if direction is None else {direction}
    return frozenset(low)


def unmatched(model: nn.Module, keep_bf16: Iterable[str]) -> list[str]:
    """Map entries whose glob names no Linear of the model (a typo the map would silently ignore)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [e for e in keep_bf16 if not any(fnmatch.fnmatchcase(n, parse_entry(e)[0]) for n in names)]


def refuse_unmatched(model: nn.Module, keep_bf16: Iterable[str]) -> None:
    """PolicyError naming the first map entry that matches no Linear, and the model's Linears."""
    missing = unmatched(model, keep_bf16)
    if missing:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise PolicyError(
            f"keep_bf16 entry {missing[0]!r} matches no Linear of the model; its Linear layers are "
            f"{', '.join(linears[:8]) or 'none'}{' ...' if len(linears) > 8 else ''}. Name one of them."
        )


def convert(
    model: nn.Module,
    spec: PolicySpec,
    keep_fp32: Iterable[str] = (),
    keep_bf16: Iterable[str] = (),
    kernel: str | None = None,
) -> LayerPlan:
    """Convert the model's Linear layers for ``spec`` in place, as ``keep_bf16`` says; returns the
    plan. fp8: torchao's Float8Linear (what an fp8 GPU runs; reference kernels elsewhere). Block
    formats: with ``kernel`` (a torchao KernelPreference name: "AUTO" where the device has the
    kernels), torchao's MXFP8/NVFP4 Linear for the layers whose GEMM directions it can express;
    everywhere else :class:`~mixprec.policy.blockscale.BlockLinear`, mixprec's emulation."""
    refuse_unmatched(model, keep_bf16)
    plan = plan_layers(model, spec, keep_fp32, keep_bf16)
    if spec.fp8_recipe is not None:
        from mixprec.policy import fp8

        fp8.convert_layers(model, spec.fp8_recipe, list(plan.low))
        return plan
    fmt = BLOCK_FORMATS[str(spec.block_format)]
    for name, low in plan.low.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        swapped = torchao_block_linear(linear, fmt, low, kernel) if kernel is not None else None
        setattr(parent, child, swapped or BlockLinear(linear, fmt, low, seed=seed_of(name)))
    return plan


def torchao_block_linear(
    linear: nn.Linear, fmt: BlockFormat, low: frozenset[str], kernel: str
) -> nn.Module | None:
    """torchao's training Linear for ``fmt`` sharing ``linear``'s parameters, where torchao can express
    ``low`` (MXFP8: all three GEMMs, or all but wgrad via ``wgrad_with_hp``; NVFP4: all three, with
    both dimensions multiples of 128); None where it cannot (the emulation runs instead). The token
    count is padded to what the kernels take (:func:`_token_padded`). ``kernel``: torchao's
    KernelPreference name ("AUTO" on Blackwell; "EMULATED" to test the path anywhere)."""
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    device = linear.weight.device
    if fmt.name == "mxfp8" and low in (frozenset(DIRECTIONS), frozenset({"forward", "dgrad"})):
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

        new = _token_padded(MXFP8Linear, 32)(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=device,
            kernel_preference=KernelPreference[kernel],
            wgrad_with_hp="wgrad" not in low,
        )
    elif fmt.name == "nvfp4" and low == frozenset(DIRECTIONS) and kernel == "AUTO":
        if linear.in_features % 128 or linear.out_features % 128:
            return None
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

        # built on the weight's device: its stochastic-rounding seed and Hadamard signs are buffers
        new = _token_padded(NVFP4Linear, 128)(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device=device
        )
    else:
        return None
    new.weight, new.bias = linear.weight, linear.bias
    return new


@functools.cache
def _token_padded(cls: type[nn.Module], multiple: int) -> type[nn.Module]:
    """``cls`` (a torchao training Linear) taking any token count: padded with zero rows to a
    multiple of ``multiple`` (its kernels' tile; zero rows change no block scale and add nothing to
    the weight gradient) and sliced back, the output in the autocast dtype as the emulation gives it
    (torchao returns its GEMM's fp32)."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        pad = (-rows) % multiple
        out = cls.forward(self, nn.functional.pad(flat, (0, 0, 0, pad)) if pad else flat)[:rows]
        device = x.device.type
        if torch.is_autocast_enabled(device):
            out = out.to(torch.get_autocast_dtype(device))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    padded = type(f"TokenPadded{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    globals()[padded.__name__] = padded  # so pickle (torch.save of a whole model) finds it by name
    return padded
