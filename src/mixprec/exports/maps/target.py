"""The precision-map family's base: an :class:`~mixprec.exports.target.ExportTarget` whose input is a
low-format candidate and the model its map resolves against. A stack overrides
:meth:`MapTarget.cannot_express` (where it cannot express a resolved map) and :meth:`MapTarget.write`
(its text); the base adds the shared device check, names the stacks of the family that can express
a refused map, and states the resolved map in the header every export has."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from torch import nn

from mixprec.errors import UsageError
from mixprec.exports.facts import Facts
from mixprec.exports.maps.resolve import GEMM, ResolvedMap, resolve
from mixprec.exports.target import Contract, ExportTarget, Refusal


@dataclass(frozen=True)
class MapRefusal:
    """Why one stack cannot express a resolved map.

    Attributes:
        entry: the ``keep_bf16`` entry (or Linear) the stack cannot express; None where the format
            itself is the reason.
        reason: why, naming what the stack has instead.
        hint: what to change in the map, put before the targets that can express it as it is.
    """

    entry: str | None
    reason: str
    hint: str = ""


@dataclass(frozen=True)
class MapText:
    """One stack's text of a resolved map, and what its header says beyond the map itself.

    Attributes:
        body: the code or configuration, newline-terminated.
        runs: what the stack does with it and what it needs to run it (GPU, releases).
        cannot: what the stack cannot express (refused, or done differently than mixprec does).
        fill_in: what the text expects from you.
        launch: how to run it, where a command line takes the text.
    """

    body: str
    runs: list[str]
    cannot: list[str]
    fill_in: str
    launch: str = ""


class MapTarget(ExportTarget):
    """A stack that takes a low-format policy's precision map. Subclasses set ``name``, ``title``,
    ``checked`` and override :meth:`cannot_express` and :meth:`write`."""

    # What the text was checked against, and how (executed, parsed, read): the header's first line.
    checked: ClassVar[str]

    def __init__(self, family: Sequence[MapTarget]) -> None:
        """``family``: every precision-map target, this one included, in vocabulary order: a refusal
        names those that can express the map (see :func:`map_family`)."""
        self.family = family

    def cannot_express(self, m: ResolvedMap) -> MapRefusal | None:
        """None when this stack expresses the resolved map, else why not."""
        return None

    def write(self, m: ResolvedMap) -> MapText:
        """The text of the resolved map, for a map :meth:`cannot_express` accepts."""
        raise NotImplementedError

    def read_model(self, facts: Facts, model: nn.Module | None) -> Facts:
        """The precision map resolved against ``model`` (required)."""
        if not isinstance(model, nn.Module):
            raise UsageError(
                f"The {self.name!r} target writes a precision map with the model's Linear names, and got "
                f"model={model!r}; pass the model: export(candidate, {self.name!r}, model=model)."
            )
        return replace(facts, precision_map=resolve(facts.config, model))

    def checked_against(self) -> str:
        return self.checked

    def refusal(self, facts: Facts) -> Refusal | None:
        only = facts.spec.device_only
        if only is not None and facts.device_type != only.device_type:
            return Refusal(only.reason, only.alternative)
        m = resolved(facts)
        refused = self.cannot_express(m)
        if refused is None:
            return None
        others = [t.name for t in self.family if t is not self and t.cannot_express(m) is None]
        can = (
            f"the {' or '.join(others)} target{'s' if len(others) > 1 else ''} can express this map"
            if others
            else "no target here expresses this map; mixprec's own policy (the `mixprec` export) runs it"
        )
        alternative = f"{refused.hint}; or {can}" if refused.hint else can
        return Refusal(refused.reason, alternative, refused.entry)

    def contract(self, facts: Facts) -> Contract:
        m = resolved(facts)
        text = self.write(m)
        layers = [
            f"in {m.fmt}: {', '.join(m.label(n) for n in m.plan.low) or 'none'}",
            f"kept in bf16 by the map: {', '.join(m.plan.kept) or 'none'}",
        ]
        if m.plan.ineligible:
            layers.append(f"bf16, shapes the format's kernels cannot take: {', '.join(m.plan.ineligible)}")
        if m.islands:
            layers.append(f"fp32 islands (keep_fp32): {', '.join(m.islands)}")
        runs = [
            f"{m.policy}: {m.spec.description}; the map resolved against the model's Linear layers:",
            *layers,
            f"share: {m.share()}",
            *text.runs,
        ]
        return Contract(runs, [*text.cannot, *_unwritten(facts)], text.fill_in, text.launch)

    def body(self, facts: Facts) -> list[str]:
        return ["", *self.write(resolved(facts)).body.splitlines()]


def map_family(*classes: type[MapTarget]) -> tuple[MapTarget, ...]:
    """One instance of each precision-map target, each knowing the others."""
    family: list[MapTarget] = []
    family += [cls(family) for cls in classes]
    return tuple(family)


def resolved(facts: Facts) -> ResolvedMap:
    """The facts' resolved precision map (:meth:`MapTarget.facts` sets it)."""
    if facts.precision_map is None:
        raise UsageError(
            f"No precision map was resolved for {facts.name!r}: get the facts of a precision-map target "
            "from its facts(candidate, device, model)."
        )
    return facts.precision_map


def _unwritten(facts: Facts) -> list[str]:
    """The note on the candidate's options a precision map does not carry (its loop and layout)."""
    options = [
        label
        for label, on in (
            ("channels_last", facts.channels_last),
            ("finite_check", facts.finite_check),
            (f"compile={facts.compile!r}", facts.compile),
            (f"compile_scope={facts.compile_scope!r}", facts.compiles_step),
            (f"optimizer={facts.optimizer!r}", facts.optimizer),
            (f"micro_batch={facts.micro_batch}", facts.micro_batch is not None),
            (f"accumulation_steps={facts.accumulation_steps}", facts.accumulates),
        )
        if on
    ]
    if not options:
        return []
    return [
        f"The candidate's {', '.join(options)}: not part of a precision map, which converts Linear layers"
        " only; write them in your loop as the 'pytorch' export does."
    ]


def whole_layer_hint(layer: str) -> str:
    return f"keep the whole layer in bf16 (entry {layer!r})"


def refuse_directions(m: ResolvedMap, why: str) -> MapRefusal | None:
    """The refusal of the map's first single-direction entry by a stack that converts layers whole."""
    found = m.first_partial(lambda kept: False)
    if found is None:
        return None
    entry, layer, direction = found
    return MapRefusal(
        entry,
        f"keep_bf16 entry {entry!r} keeps only {layer}'s {GEMM[direction]} in bf16; {why}",
        whole_layer_hint(layer),
    )


def py_set(name: str, names: Sequence[str], comment: str) -> str:
    """``name = frozenset([...])`` under a ``#`` comment, one name a line, as ruff format writes it."""
    body = "".join(f"        {json.dumps(n)},\n" for n in names)
    return f"# {comment}\n{name} = frozenset(\n    [\n{body}    ]\n)\n"
