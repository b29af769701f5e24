"""A precision map resolved against one model: the exact Linear names each ``keep_bf16`` entry
(a glob, optionally with a GEMM direction) stands for, and the share of the Linear GEMM work in the
format."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mixprec.errors import PolicyError, UsageError
from mixprec.policy.blockscale import DIRECTIONS
from mixprec.policy.lowformat import LayerPlan, parse_entry, plan_layers, refuse_unmatched, validate_map
from mixprec.policy.policy import PolicyConfig
from mixprec.policy.registry import POLICIES, PolicySpec

LOW_FORMAT_POLICIES: tuple[str, ...] = tuple(n for n, s in POLICIES.items() if s.low_format is not None)
# What each GEMM direction is, for the texts.
GEMM = {"forward": "forward GEMM", "dgrad": "input-gradient GEMM (dgrad)", "wgrad": "weight-gradient GEMM"}


@dataclass(frozen=True)
class ResolvedMap:
    """A precision map resolved against one model.

    Attributes:
        policy: the low-format policy's canonical name.
        spec: its :class:`~mixprec.policy.registry.PolicySpec`.
        fmt: its low format ("fp8", "mxfp8", "nvfp4").
        entries: the map (``keep_bf16``) as given.
        plan: the model's Linear layers under the policy and the map.
        shapes: every nn.Linear (subclasses too) -> (in_features, out_features), in model order.
        islands: the Linear layers in keep_fp32 islands (out of the format by design).
    """

    policy: str
    spec: PolicySpec
    fmt: str
    entries: tuple[str, ...]
    plan: LayerPlan
    shapes: dict[str, tuple[int, int]]
    islands: tuple[str, ...]

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

    def first_partial(self, allowed: Callable[[frozenset[str]], bool]) -> tuple[str, str, str] | None:
        """(entry, layer, direction) of the first direction entry whose layer's kept set is not allowed."""
        for layer, kept in self.partial.items():
            if not allowed(kept):
                direction = next(d for d in DIRECTIONS if d in kept)
                return self.entry_for(layer, direction), layer, direction
        return None

    def left(self) -> list[str]:
        """Every Linear outside the format (kept, ineligible, in an fp32 island), in model order."""
        return [n for n in self.shapes if n not in self.plan.low]

    def label(self, name: str) -> str:
        """A converted layer's name, with the directions it keeps in bf16."""
        kept = frozenset(DIRECTIONS) - self.plan.low[name]
        return f"{name} (all but {'/'.join(d for d in DIRECTIONS if d in kept)})" if kept else name

    def share(self) -> str:
        """How much of the model's Linear layers, GEMMs and GEMM work the map runs in the format."""
        work = {n: k * o for n, (k, o) in self.shapes.items()}
        total = 3 * sum(work.values()) or 1
        low = sum(len(d) * work[n] for n, d in self.plan.low.items())
        gemms = sum(len(d) for d in self.plan.low.values())
        return (
            f"{len(self.plan.low)} of {len(self.shapes)} Linear layers run in {self.fmt}; {gemms} of "
            f"{3 * len(self.shapes)} Linear GEMMs, {100.0 * low / total:.1f}% of the Linear GEMM work "
            "(in_features x out_features per token)"
        )


def resolve(config: PolicyConfig, model: nn.Module) -> ResolvedMap:
    """``config``'s precision map (``keep_bf16``, with ``keep_fp32``'s islands left out) on ``model``.

    Raises :class:`~mixprec.errors.PolicyError` for a policy without a low format or a map entry that
    is invalid or names no Linear of the model, and :class:`~mixprec.errors.UsageError` for a model
    that is itself a Linear.
    """
    spec = config.spec
    if spec.low_format is None:
        raise PolicyError(
            f"A precision map belongs to a low-format Linear policy ({', '.join(LOW_FORMAT_POLICIES)}); "
            f"{spec.name!r} runs no Linear in a low format."
        )
    entries = validate_map(spec, config.keep_bf16)
    refuse_unmatched(model, entries)
    shapes = {
        n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    if "" in shapes:
        raise UsageError(
            "The model is itself a Linear layer: a precision map names layers inside a model. Wrap it "
            "(e.g. nn.Sequential(linear)) and name the layer '0'."
        )
    plan = plan_layers(model, spec, config.keep_fp32, entries)
    placed = {*plan.low, *plan.kept, *plan.ineligible}
    islands = tuple(n for n in shapes if n not in placed)
    return ResolvedMap(spec.name, spec, str(spec.low_format), entries, plan, shapes, islands)
