"""The keep_fp32 search both frameworks' checks share: grow a set of layers kept in fp32 from the
most suspicious first until the candidate passes, drop every layer it passes without, then verify
the set over every checked step. What "suspicious" means (the search order) is the caller's."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

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
    result.fix_verified = verified
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
