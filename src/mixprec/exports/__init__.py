"""Export a candidate (a precision policy with its loop axes) as ready-to-paste code or
configuration for other training stacks.

One module per target, each an :class:`~mixprec.exports.target.ExportTarget` that states what it
cannot express faithfully, all named in one vocabulary (:mod:`.registry`):

- ``mixprec`` (:mod:`.native`): the ``get_policy(...)`` call with exactly the non-default options.
- ``pytorch`` (:mod:`.pytorch`): plain PyTorch without mixprec, everything Policy does written out.
- ``lightning``, ``accelerate``, ``deepspeed``, ``fsdp2``, ``hf``: that stack's own settings where they
  mean the policy, code where they do not, and a refusal where the stack cannot run the policy.
- the precision-map targets ``torchao``, ``torchtitan``, ``accelerate-fp8``, ``megatron``,
  ``transformer-engine`` (:mod:`.maps`): a low-format policy's precision map (``keep_bf16``) with
  the model's Linear names, for the stack that trains with it; they take the model
  (``export(candidate, "torchao", model=model)``).

Each writes the candidate's ``torch.compile`` mode and optimizer implementation the way its stack
runs them (Lightning compiles the LightningModule, Accelerate and the HF Trainer take a dynamo
backend, DeepSpeed ``engine.compile()``, FSDP2 compiles after ``fully_shard``). A candidate compiled
at step scope (``compile_scope="step"``: forward, loss, backward and optimizer step in one compiled
function) is written as a compiled ``train_step`` where the user writes the loop (``mixprec``,
``pytorch``, ``accelerate``, ``fsdp2``) and refused where the stack owns the optimizer step
(Lightning, the HF Trainer, DeepSpeed).

Every text starts with its contract (what runs, what the stack cannot express and what is done
instead, what the user fills in). Texts that hold more than one file (``accelerate``: YAML +
Python, ``deepspeed``: JSON + Python) start each file with a ``# --- <file name> ---`` line;
:func:`split_sections` splits them. Helper code comes from :mod:`.snippets` (real, tested Python,
shared with :class:`mixprec.Policy`). Pure text: nothing is imported from the target stacks and no
global state is touched.

The module layout: :mod:`.facts` (a candidate as the facts every target writes from),
:mod:`.target` (the target interface, its refusal and its contract header), :mod:`.text` (text
helpers), :mod:`.prepare` and :mod:`.loop` (the model preparation and loop lines the loop-writing
targets share), :mod:`.snippets` (the pasted helper code), one module per target, :mod:`.maps`
(the precision-map family) and :mod:`.registry` (the vocabulary).

Faithful or refused: :func:`export` raises :class:`~mixprec.errors.ExportRefused` (a
:class:`~mixprec.errors.UsageError`) with the reason and the nearest faithful alternative;
:func:`export_status` answers without raising; :func:`export_all` returns an :class:`ExportResult`
per training-code target, with the text of a faithful target and the reason of a refused one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from mixprec.errors import ExportRefused
from mixprec.exports.facts import Facts
from mixprec.exports.registry import EXPORT_TARGETS, MAP_TARGETS, TARGETS, check_target
from mixprec.exports.target import ExportTarget
from mixprec.exports.text import SECTION_PREFIX, SECTION_SUFFIX
from mixprec.policy.candidate import Candidate
from mixprec.policy.policy import Policy, PolicyConfig

__all__ = [
    "EXPORT_TARGETS",
    "FRAMEWORKS",
    "MAP_TARGETS",
    "ExportRefused",
    "ExportResult",
    "ExportStatus",
    "export",
    "export_all",
    "export_status",
    "split_sections",
]

# The PyPI package each framework target relies on -> the releases its exports were checked against.
FRAMEWORKS: dict[str, str] = {t.package: t.verified for t in TARGETS.values() if t.package}


class ExportStatus(NamedTuple):
    """Whether a target expresses a policy faithfully; ``reason`` says why not (with the nearest
    faithful alternative), or is empty."""

    faithful: bool
    reason: str


class ExportResult(NamedTuple):
    """One target's export: ``text`` when faithful, else ``refused`` (the reason and alternative)."""

    text: str | None
    refused: str | None

    @property
    def faithful(self) -> bool:
        return self.text is not None


def export(
    candidate: Candidate | PolicyConfig | Policy,
    target: str,
    *,
    device: str | torch.device | None = None,
    model: nn.Module | None = None,
) -> str:
    """Ready-to-paste text that trains ``candidate`` with ``target`` (one of :data:`EXPORT_TARGETS`,
    or of :data:`MAP_TARGETS` with ``model``).

    ``candidate`` is a :class:`~mixprec.Candidate` (a recommendation's ``.candidate``: policy,
    channels_last, keep_fp32, keep_bf16, compile mode and scope, optimizer implementation), exported
    for ``device`` (default: mixprec's, CUDA when available, else CPU). A :class:`PolicyConfig` or
    :class:`Policy` works too (it also carries finite_check and the scaler options): exported eager,
    with the optimizer as written, for its own device unless ``device`` is given. ``model``: the
    model a precision-map target resolves the candidate's ``keep_bf16`` against (its Linear names);
    the fsdp2 target counts on it the fully_shard units keep_fp32 adds, for its header; the other
    targets write code around your model and ignore it. Raises :class:`UsageError` for an
    unknown target, another object, a non-torch candidate, loop axes mixprec's torch backend does
    not run, a policy or device mixprec does not know, or a precision-map target without a model,
    :class:`~mixprec.errors.PolicyError` for a precision map that is invalid or names no Linear of
    the model, and :class:`ExportRefused` (a UsageError) where the target cannot train the candidate
    faithfully.
    """
    target_obj = check_target(target)
    return target_obj.export(target_obj.facts(candidate, device, model))


def export_status(
    candidate: Candidate | PolicyConfig | Policy,
    target: str,
    *,
    device: str | torch.device | None = None,
    model: nn.Module | None = None,
) -> ExportStatus:
    """``(faithful, reason)`` for ``export(candidate, target, device=device, model=model)``, without
    raising a refusal."""
    target_obj = check_target(target)
    facts = target_obj.facts(candidate, device, model)
    if target_obj.refusal(facts) is None:
        return ExportStatus(True, "")
    return ExportStatus(False, _refusal_text(target_obj, facts))


def export_all(
    candidate: Candidate | PolicyConfig | Policy,
    *,
    device: str | torch.device | None = None,
    model: nn.Module | None = None,
) -> dict[str, ExportResult]:
    """An :class:`ExportResult` for every target of :data:`EXPORT_TARGETS`, in that order; the
    arguments are :func:`export`'s (``model``: the fsdp2 target counts on it the fully_shard units
    keep_fp32 adds)."""
    results = {}
    for name, target in TARGETS.items():
        facts = target.facts(candidate, device, model)
        try:
            results[name] = ExportResult(target.export(facts), None)
        except ExportRefused:
            results[name] = ExportResult(None, _refusal_text(target, facts))
    return results


def _refusal_text(target: ExportTarget, facts: Facts) -> str:
    refused = target.refusal(facts)
    assert refused is not None
    return f"{refused.reason}; instead: {refused.alternative}"


def split_sections(text: str) -> dict[str, str]:
    """Split an exported text at its ``# --- <file name> ---`` lines into ``{file name: content}``.

    What precedes the first marker (the header comments) is returned under ``""``; a text without
    markers is a single section ``{"": text}``.
    """
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        if line.startswith(SECTION_PREFIX) and line.endswith(SECTION_SUFFIX) and len(line) > 10:
            current = line[len(SECTION_PREFIX) : -len(SECTION_SUFFIX)].strip()
            sections[current] = []
        else:
            sections[current].append(line)
    return {name: "\n".join(lines).strip("\n") + "\n" for name, lines in sections.items()}
