"""`tune`: the fastest policy that trains correctly, with the evidence.

1. Measure every supported policy x layout with the bench machinery (hopeless ones pruned),
   until 60% of the budget is spent.
2. Gate the candidates that beat strict fp32 by the numerics check, fastest first; a failing
   one may be rescued by a keep_fp32 set, which is then measured at its real cost.
3. Decide (:func:`mixprec.tuning.decide.decide`); when the pick ties with a faster candidate
   within noise and budget is left, re-measure both and decide again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import torch

from mixprec.errors import UsageError
from mixprec.hardware import environment
from mixprec.hardware.device import DeviceInfo, detect, resolve_device
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.measure.sweep import bench, has_4d_weights
from mixprec.numerics.check import check, make_checker
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.policy import POLICY_NAMES, Candidate, check_support
from mixprec.status import Status
from mixprec.tuning.decide import Recommendation, Verdicts, decide, noise_band, speed, within_noise
from mixprec.tuning.result import TuneResult
from mixprec.workload import Workload

Progress = Callable[[str], None]
# Share of the budget the speed sweep may use; the numerics checks and rescues get the rest.
SPEED_SHARE = 0.6
# Seconds kept back at the end for deciding, linting and writing.
RESERVE_S = 10.0


def tune_candidates(info: DeviceInfo, has_4d: bool) -> list[Candidate]:
    """Every supported policy in every useful layout; unsupported ones once, so the table says why."""
    layouts = (False, True) if has_4d else (False,)
    return [
        Candidate(p, cl) for p in POLICY_NAMES for cl in (layouts if check_support(p, info) else (False,))
    ]


def tune(
    workload: Workload,
    *,
    budget_s: float = 180.0,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    steps: int = 4,
    warmup: int = 1,
    check_steps: int = 6,
    fix: bool = True,
    lint: bool = True,
    noise: float = 0.03,
    progress: Progress | None = None,
) -> TuneResult:
    """Find the fastest policy that trains like fp32 on ``workload`` within ``budget_s`` seconds.

    Args:
        workload: the model, its batches, loss and optimizer.
        budget_s: seconds for the whole search (measuring, checking, rescuing, re-measuring).
        device: 'cpu', 'cuda[:N]' (default: CUDA when available).
        batch_size: samples per step (default: the workload's).
        steps / warmup: timed and untimed steps per candidate in the speed sweep.
        check_steps: training steps compared with the strict-fp32 reference.
        fix: search a keep_fp32 rescue for a candidate that fails its check.
        lint: lint the model under the recommended policy.
        noise: the smallest relative throughput difference treated as real.
        progress: receives one line per stage.
    """
    from mixprec.exports import export_all

    if not isinstance(workload, Workload):
        raise UsageError(f"tune() takes a mixprec.Workload, got {type(workload).__name__}.")
    if isinstance(budget_s, bool) or not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise UsageError(f"budget must be a number of seconds > 0, got {budget_s!r}.")
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    deadline = start + budget_s
    dev = resolve_device(device)
    info = detect(dev)
    notes: list[str] = []
    sweep: dict[str, Any] = dict(batch_size=batch_size, steps=steps, warmup=warmup, device=dev)

    def on_bench(event: dict[str, Any]) -> None:
        if event["event"] == "candidate":
            say(f"measuring {event['label']} ({event['index'] + 1}/{event['count']})")

    # 1. speed
    result = bench(
        workload,
        candidates=tune_candidates(info, has_4d_weights(workload.model)),
        progress=on_bench,
        deadline=start + SPEED_SHARE * budget_s,
        **sweep,
    )
    if result.stopped:
        notes.append(f"speed sweep {result.stopped}")

    # 2. numerics, fastest policy first; stop once one passes and nothing faster is left within noise
    verdicts: dict[Candidate, CandidateCheck] = {}
    checked: CheckResult | None = None
    checker = None  # one fp32 reference + chaos floor shared by every policy checked
    fp32 = result.baseline
    faster = sorted(
        (
            r
            for r in result.rows
            if r.status == Status.OK
            and not r.baseline_repeat
            and r.policy != "fp32"
            and fp32 is not None
            and speed(r) > 1.0
        ),
        key=lambda r: -speed(r),
    )
    best_pass: BenchRow | None = None
    for numerics in dict.fromkeys(r.candidate.numerics for r in faster):
        top = max((r for r in faster if r.candidate.numerics == numerics), key=speed)
        if best_pass is not None and not within_noise(
            speed(top), speed(best_pass), noise_band(top, best_pass, noise)
        ):
            break  # slower than a passing candidate by more than the noise: cannot win
        if time.perf_counter() > deadline - RESERVE_S:
            notes.append(f"numerics of {numerics.label} not checked: budget spent")
            break
        say(f"checking numerics of {numerics.label}")
        if checker is None:
            checker = make_checker(
                workload,
                steps=check_steps,
                batch_size=batch_size,
                device=dev,
                progress=lambda m: say(f"checking {m}"),
                deadline=deadline - RESERVE_S,
            )
        res = check(workload, policies=[numerics], fix=fix, checker=checker)
        verdict = res.candidates[0]
        verdicts[numerics] = verdict
        if checked is None:
            checked = res
        else:
            checked.candidates.extend(res.candidates)
        if verdict.passed and (best_pass is None or speed(top) > speed(best_pass)):
            best_pass = top
        elif verdict.fix_keep_fp32 and verdict.fix_verified and time.perf_counter() < deadline - RESERVE_S:
            verdicts.update(_measure_rescue(workload, result, faster, verdict, sweep, deadline, say))

    # 3. decide, re-measuring a tie within noise while budget is left
    rec, ranked = decide(result.rows, verdicts, noise=noise)
    if (
        rec is not None
        and (rec.tied_with or rec.noisy_with)
        and _remeasure_tie(workload, result, rec, sweep, deadline, say, notes)
    ):
        rec, ranked = decide(result.rows, verdicts, noise=noise)
    findings = None
    if lint and rec is not None and time.perf_counter() < deadline:
        findings = _lint(workload, rec, dev, notes)
        if findings:
            rec.lint_worth_fixing = [f for f in findings if f.get("severity") in ("warning", "error")][:5]
    exports = export_all(rec.config(str(dev))) if rec else {}
    return TuneResult(
        workload=result.workload,
        description=workload.description,
        device=str(dev),
        recommendation=rec,
        ranked=ranked,
        bench=result,
        check=checked,
        lint=findings,
        budget_s=budget_s,
        elapsed_s=time.perf_counter() - start,
        env=result.env or environment.collect(dev),
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        notes=notes,
        exports={target: r.text for target, r in exports.items() if r.text is not None},
        export_refusals={target: r.refused for target, r in exports.items() if r.refused is not None},
    )


def _measure_rescue(
    workload: Workload,
    result: BenchResult,
    faster: list[BenchRow],
    verdict: CandidateCheck,
    sweep: dict[str, Any],
    deadline: float,
    say: Progress,
) -> Verdicts:
    """Measure a failing policy rescued by keep_fp32 (fp32 islands are not free) and return its
    verdict, built from the verifying run's figures."""
    base = verdict.candidate
    layouts = sorted({r.channels_last for r in faster if r.candidate.numerics == base})
    rescued = [
        replace(base, channels_last=cl, keep_fp32=(*base.keep_fp32, *verdict.fix_keep_fp32)) for cl in layouts
    ]
    say(f"measuring rescued {base.label} with keep_fp32={verdict.fix_keep_fp32}")
    # bench measures fp32 first as well; the rescued rows join the sweep's own baseline below
    extra = bench(workload, candidates=rescued, deadline=deadline, **sweep)
    added = [r for r in extra.measured if r.keep_fp32]
    if not added:
        result.notes.append(f"rescued {base.label} not measured: budget spent")
        return {}
    for row in added:
        result.add(row)
    metrics: dict[str, Any] = {
        k: v for k, v in verdict.fix_metrics.items() if k in CandidateCheck.__dataclass_fields__
    }
    fixed = replace(
        verdict, **metrics, candidate=rescued[0].numerics, verdict=Status.PASS, reason=verdict.fix_note
    )
    return {fixed.candidate: fixed}


def _remeasure_tie(
    workload: Workload,
    result: BenchResult,
    rec: Recommendation,
    sweep: dict[str, Any],
    deadline: float,
    say: Progress,
    notes: list[str],
) -> bool:
    """Time the recommended row and the one it tied with (or could not be separated from) again,
    twice as long, and fold the new paired rounds into both rows. False when the budget cannot
    pay for it."""
    rows = {r.candidate: r for r in result.rows if r.status == Status.OK and not r.baseline_repeat}
    chosen, rival = rows[rec.candidate], rows[rec.tied_with or rec.noisy_with]  # type: ignore[index]
    base = result.baseline
    steps = 2 * sweep["steps"]
    # bench measures fp32 first as well: pay for it too
    cost = sum(
        (sweep["warmup"] + steps) * (r.step_time_ms.median_ms / 1e3)
        for r in (chosen, rival, base)
        if r is not None and r.step_time_ms
    )
    if time.perf_counter() + 1.5 * cost > deadline:
        notes.append(f"{chosen.label} and {rival.label} tie within noise; no budget left to re-measure them")
        return False
    say(f"re-measuring {chosen.label} and {rival.label}: within noise of each other")
    again = bench(
        workload,
        candidates=[chosen.candidate, rival.candidate],
        deadline=deadline,
        **{**sweep, "steps": steps},
    )
    extra = {r.candidate: r for r in again.measured if r.status == Status.OK}
    redone = [row for row in (chosen, rival) if row.candidate in extra]
    for row in redone:
        new = extra[row.candidate]
        merged = replace(
            row,
            step_times_ms=row.step_times_ms + new.step_times_ms,
            paired_ratios=row.paired_ratios + new.paired_ratios,
        )
        result.update(merged)
    if not redone:
        notes.append("re-measurement of the tie stopped by the budget")
        return False
    notes.append(
        f"{' and '.join(r.label for r in redone)} re-measured with {steps} more steps each: "
        f"{chosen.label} and {rival.label} were within noise"
    )
    return True


def _lint(
    workload: Workload, rec: Recommendation, device: torch.device, notes: list[str]
) -> list[dict] | None:
    from mixprec.linting import lint as run_lint

    try:
        findings = run_lint(workload, policy=rec.candidate.policy, device=device)
    except Exception as exc:  # lint is advice: its failure must not lose the recommendation
        notes.append(f"lint failed: {type(exc).__name__}: {exc}")
        return None
    return [f.to_dict() for f in findings]
