"""The keep_fp32 search both frameworks' checks share: grow a set of layers kept in fp32 from the
most suspicious first until the candidate passes, drop every layer it passes without, then verify
the set over every checked step. What "suspicious" means (the search order) is the caller's."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mixprec.numerics.results import CandidateCheck
from mixprec.policy import Candidate

# run(candidate, keep_fp32, steps) -> (passed, reason, comparison, ...) for a differential run
Run = Callable[[Candidate, Sequence[str], int | None], tuple]


def search_keep_fp32(
    run: Run,
    cand: Candidate,
    result: CandidateCheck,
    order: Sequence[str],
    max_set: int,
    *,
    steps: int,
    search_steps: int,
    deadline: float,
    stage: Callable[[str], None],
    kind: str = "fp32 modules",
) -> None:
    """Fill ``result``'s fix fields from a search over the first ``max_set`` names of ``order``;
    ``kind`` names what is kept in fp32 in the note when nothing helps."""
    order = list(order)[:max_set]
    chosen: list[str] = []
    passed = False
    for name in order:
        if time.perf_counter() > deadline:
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
        if time.perf_counter() > deadline:
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


def search_precision_map(
    run: MapRun,
    cand: Candidate,
    result: CandidateCheck,
    *,
    layers: Sequence[str],
    rules: Sequence[str],
    suspects: Sequence[str],
    directions: Sequence[str],
    steps: int,
    search_steps: int,
    deadline: float,
    stage: Callable[[str], None],
    present: dict[str, frozenset[str]] | None = None,
) -> None:
    """The smallest precision map (Linear layers, or single GEMM directions of them, kept in bf16)
    with which ``cand`` passes: start from the field's fixed rules (``rules``: first and last
    layers, the LM head, layers the format cannot speed up), add the ``suspects`` (then the other
    ``layers``) until it passes, drop every entry it passes without, narrow each remaining layer to
    one GEMM direction where that passes (``directions``: empty for fp8, whose layers convert
    whole; ``present``: the directions each layer's step runs, a frozen weight has no wgrad), then
    verify over ``steps``. Fills ``result.fix_keep_bf16`` and the fix fields."""

    def passes(entries: Sequence[str], n: int) -> bool:
        stage(f"{cand.label}: trying keep_bf16={list(entries)}")
        return bool(run(entries, n)[0])

    chosen = [n for n in rules if n in layers]
    passed = bool(chosen) and passes(chosen, search_steps)
    for name in [*suspects, *layers]:
        if passed or time.perf_counter() > deadline:
            break
        if name in chosen or name not in layers:
            continue
        chosen.append(name)
        passed = passes(chosen, search_steps)
    if not passed:
        if len(chosen) < len(layers):  # stopped by the budget, not by running out of layers
            result.fix_note = (
                f"precision map search stopped: time budget spent after {len(chosen)} of {len(layers)} "
                f"Linear layers in bf16 (--budget raises it); {result.suggestion or 'use bf16-mixed'}"
            )
        else:
            result.fix_note = (
                f"no precision map makes {cand.label} pass, not even all {len(layers)} Linear layers in "
                f"bf16: the loss is outside the Linear GEMMs; {result.suggestion or 'use bf16-mixed'}"
            )
        return
    for name in list(chosen):  # drop every layer it passes without (the rules' included)
        if time.perf_counter() > deadline:
            break
        trial = [n for n in chosen if n != name]
        if trial and passes(trial, search_steps):
            chosen = trial
    for name in list(chosen):  # one GEMM direction instead of the whole layer, where one is enough
        runs = (present or {}).get(name)
        for direction in (d for d in directions if runs is None or d in runs):
            if time.perf_counter() > deadline:
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
        if verified or time.perf_counter() > deadline:
            break
        chosen = [e.split(":")[0] if e == entry else e for e in chosen]
        stage(f"{cand.label}: verifying keep_bf16={chosen}")
        verified, reason, cmp, *_ = run(chosen, steps)
    rest = [n for n in [*suspects, *layers] if n in layers and not any(e.split(":")[0] == n for e in chosen)]
    for name in dict.fromkeys(rest):
        if verified or time.perf_counter() > deadline:
            break
        chosen = [*chosen, name]
        stage(f"{cand.label}: verifying keep_bf16={chosen}")
        verified, reason, cmp, *_ = run(chosen, steps)
    result.fix_keep_bf16 = chosen
    record_verification(result, verified, reason, cmp, steps, search_steps)
