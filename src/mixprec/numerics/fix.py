"""The keep_fp32 search both frameworks' checks share: grow a set of layers kept in fp32 from the
most suspicious first until the candidate passes, drop every layer it passes without, then verify
the set over every checked step. What "suspicious" means (the search order) is the caller's."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixprec.budget import Budget
from mixprec.numerics.results import CandidateCheck
from mixprec.policy import Candidate

# run(candidate, keep_fp32, steps) -> (passed, reason, comparison, ...) for a differential run
Run = Callable[[Candidate, Sequence[str], int | None], tuple]


@dataclass(frozen=True)
class Trials:
    """How a search runs: each trial ``search_steps`` long, the found set verified over ``steps``,
    while ``budget`` lasts (its ``stop`` too); ``stage`` reports each trial."""

    steps: int
    search_steps: int
    budget: Budget
    stage: Callable[[str], None]

    def over(self) -> bool:
        return self.budget.expired()


def search_keep_fp32(
    run: Run,
    cand: Candidate,
    result: CandidateCheck,
    order: Sequence[str],
    max_set: int,
    trials: Trials,
    kind: str = "fp32 modules",
) -> None:
    """Fill ``result``'s fix fields from a search over the first ``max_set`` names of ``order``;
    ``kind`` names what is kept in fp32 in the note when nothing helps."""
    order = list(order)[:max_set]
    chosen: list[str] = []
    passed = False
    run = _remembered(run)
    stage, steps, search_steps = trials.stage, trials.steps, trials.search_steps
    for name in order:
        if trials.over():
            break
        chosen.append(name)
        stage(f"{cand.label}: trying keep_fp32={chosen}")
        passed = run(cand, chosen, search_steps)[0]
        if passed:
            break
    if not passed:
        result.fix_note = (
            f"no set of up to {max_set} {kind} makes {cand.label} pass "
            f"(tried {', '.join(order) or 'none'}); {result.suggestion or 'another format'}"
        )
        return
    # Delta-debugging-style minimisation: drop every module the candidate passes without.
    for name in list(chosen):
        if trials.over():
            break
        trial = [n for n in chosen if n != name]
        if trial and run(cand, trial, search_steps)[0]:
            chosen = trial
    stage(f"{cand.label}: verifying keep_fp32={chosen}")
    verified, reason, cmp, *_ = run(cand, chosen, steps)
    result.fix_keep_fp32 = chosen
    record_verification(result, verified, reason, cmp, steps, search_steps)


def record_verification(
    result: CandidateCheck, verified: bool, reason: str, cmp: Any, steps: int, search_steps: int
) -> None:
    """The fix fields of ``result`` from the verifying run's figures."""
    result.fix_verified = bool(verified)
    result.fix_metrics = {
        "max_rel_loss_diff": cmp.max_rel_loss_diff,
        "output_sqnr_db": cmp.output_sqnr_db,
        "total_grad_sqnr_db": cmp.total_grad_sqnr_db,
        "min_grad_sqnr_db": cmp.min_grad_sqnr_db,
        "skipped_steps": cmp.skipped_steps,
        "steps": steps,
    }
    result.fix_note = (
        f"verified over {steps} steps: {reason}"
        if verified
        else f"passes over {search_steps} steps but not over {steps}: {reason}"
    )


# run(keep_bf16 entries, steps) -> (passed, reason, comparison, ...) for a differential run
MapRun = Callable[[Sequence[str], int], tuple]


def _remembered(run: Callable[..., tuple]) -> Callable[..., tuple]:
    """``run`` that runs each (entries, steps) once: verifying a set over as many steps as a trial
    already ran it (a check of a few steps searches at its full length) is that trial, not a second
    run of the user's training (a launch of their script, several seconds each)."""
    seen: dict[str, tuple] = {}

    def once(*args: Any) -> tuple:
        key = repr([list(a) if isinstance(a, (list, tuple)) else a for a in args])
        if key not in seen:
            seen[key] = run(*args)
        return seen[key]

    return once


@dataclass(frozen=True)
class MapSpace:
    """What a precision-map search may keep in bf16.

    Attributes:
        layers: the Linear layers the format converts.
        rules: the field's fixed rules, tried first (first and last layers, the LM head, layers the
            format cannot speed up).
        suspects: the layers it quantises worst, tried next (then the other ``layers``).
        directions: the GEMM directions a layer may be narrowed to (empty for fp8, whose layers
            convert whole).
        present: the directions each layer's step runs (a frozen weight has no wgrad).
    """

    layers: Sequence[str]
    rules: Sequence[str] = ()
    suspects: Sequence[str] = ()
    directions: Sequence[str] = ()
    present: Mapping[str, frozenset[str]] = field(default_factory=dict)


def search_precision_map(
    run: MapRun, cand: Candidate, result: CandidateCheck, space: MapSpace, trials: Trials
) -> None:
    """The smallest precision map (Linear layers, or single GEMM directions of them, kept in bf16)
    with which ``cand`` passes: start from ``space``'s rules, add its suspects (then the other
    layers) until it passes, drop every entry it passes without, narrow each remaining layer to one
    GEMM direction where that passes, then verify over ``trials.steps``. Fills
    ``result.fix_keep_bf16`` and the fix fields."""
    layers, rules, suspects = space.layers, space.rules, space.suspects
    directions, present = space.directions, space.present
    stage, steps, search_steps = trials.stage, trials.steps, trials.search_steps
    run = _remembered(run)

    def passes(entries: Sequence[str], n: int) -> bool:
        stage(f"{cand.label}: trying keep_bf16={list(entries)}")
        return bool(run(entries, n)[0])

    chosen = [n for n in rules if n in layers]
    passed = bool(chosen) and passes(chosen, search_steps)
    for name in [*suspects, *layers]:
        if passed or trials.over():
            break
        if name in chosen or name not in layers:
            continue
        chosen.append(name)
        passed = passes(chosen, search_steps)
    if not passed:
        if len(chosen) < len(layers):  # stopped by the budget, not by running out of layers
            why = trials.budget.why_ended()
            raise_it = "" if trials.budget.interrupted() else " (--budget raises it)"
            result.fix_note = (
                f"precision map search stopped: {why} after {len(chosen)} of {len(layers)} "
                f"Linear layers in bf16{raise_it}; {result.suggestion or 'use bf16-mixed'}"
            )
        else:
            result.fix_note = (
                f"no precision map makes {cand.label} pass, not even all {len(layers)} Linear layers in "
                f"bf16: the loss is outside the Linear GEMMs; {result.suggestion or 'use bf16-mixed'}"
            )
        return
    for name in list(chosen):  # drop every layer it passes without (the rules' included)
        if trials.over():
            break
        trial = [n for n in chosen if n != name]
        if trial and passes(trial, search_steps):
            chosen = trial
    for name in list(chosen):  # one GEMM direction instead of the whole layer, where one is enough
        runs = present.get(name)
        for direction in (d for d in directions if runs is None or d in runs):
            if trials.over():
                break
            trial = [f"{name}:{direction}" if n == name else n for n in chosen]
            if passes(trial, search_steps):
                chosen = trial
                break
    stage(f"{cand.label}: verifying keep_bf16={chosen}")
    verified, reason, cmp, *_ = run(chosen, steps)
    # A map that passed the short trials but not the whole run grows on, judged over the whole run
    # (the late failure is the evidence: no trial shorter than it can see it): first a narrowed layer
    # back to the whole layer, then more layers.
    for entry in [e for e in chosen if ":" in e]:
        if verified or trials.over():
            break
        chosen = [e.split(":")[0] if e == entry else e for e in chosen]
        stage(f"{cand.label}: verifying keep_bf16={chosen}")
        verified, reason, cmp, *_ = run(chosen, steps)
    rest = [n for n in [*suspects, *layers] if n in layers and not any(e.split(":")[0] == n for e in chosen)]
    for name in dict.fromkeys(rest):
        if verified or trials.over():
            break
        chosen = [*chosen, name]
        stage(f"{cand.label}: verifying keep_bf16={chosen}")
        verified, reason, cmp, *_ = run(chosen, steps)
    result.fix_keep_bf16 = chosen
    record_verification(result, verified, reason, cmp, steps, search_steps)
