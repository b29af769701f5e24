"""``render(policy, model, keep_bf16, target)``: a low-format policy's precision map written for one
of the precision-map targets (:data:`MAP_TARGETS`, see :mod:`mixprec.exports.maps`), a shorthand for
``mixprec.export(Candidate(policy, keep_fp32=..., keep_bf16=...), target, device="cuda",
model=model)``: the stacks that take a map train on a GPU."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from mixprec.errors import UsageError, did_you_mean
from mixprec.exports.registry import MAP_TARGETS, MAPS, check_target
from mixprec.policy.candidate import Candidate

__all__ = ["MAP_TARGETS", "render"]


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
    that is invalid or names no Linear of the model, :class:`~mixprec.errors.UsageError` for a
    target that is not a precision-map target, and :class:`~mixprec.errors.ExportRefused` (a
    UsageError) where the target cannot express the map.
    """
    chosen = check_target(target)
    if chosen.name not in MAPS:
        raise UsageError(
            f"{target!r} is the training-code export target {chosen.name!r} (mixprec.export), not a "
            f"precision-map target; valid: {', '.join(MAP_TARGETS)}.{did_you_mean(str(target), MAP_TARGETS)}"
        )
    candidate = Candidate(policy, keep_fp32=tuple(keep_fp32), keep_bf16=tuple(keep_bf16))
    return chosen.export(chosen.facts(candidate, "cuda", model))
