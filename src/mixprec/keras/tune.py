"""`tune` for Keras workloads: measure, gate by numerics, decide, export, on the shared decision.

1. Speed: every policy TensorFlow runs natively on the device, the plain tf.function step, paired
   with strict fp32 (policies it would only emulate are listed as not tried, with the reason; bench
   measures them).
2. Numerics: candidates that beat strict fp32, fastest first, until one passes; a failing one may
   be rescued by float32 layers, then measured at its real cost.
3. XLA: the best passing candidates again with ``jit_compile=True`` (compile time amortised over
   ``train_steps`` by :func:`mixprec.tuning.decide.decide`), and their numerics.
4. Decide (:func:`mixprec.tuning.decide.decide`) and export the pick as Keras code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from mixprec.errors import UsageError
from mixprec.hardware.device import detect
from mixprec.keras import backend
from mixprec.keras.check import KerasChecker, check, make_checker
from mixprec.keras.export import keras_code
from mixprec.keras.policy import keras_support
from mixprec.keras.sweep import BASELINE, bench
from mixprec.keras.workload import KerasWorkload
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.policy import POLICY_NAMES, Candidate
from mixprec.status import Status
from mixprec.tuning.decide import decide, noise_band, speed, within_noise
from mixprec.tuning.result import TuneResult
from mixprec.tuning.search import RESERVE_S, SPEED_SHARE, TRAIN_STEPS

Progress = Callable[[str], None]
XLA_TOP = 1  # how many of the best passing candidates are measured again under XLA


def tune_plan(info: Any) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """(candidates to measure, (candidate, why not) for the rest): natively supported policies only."""
    measure, skipped = [], []
    for name in POLICY_NAMES:
        cand = Candidate(name, framework="tensorflow")
        support = keras_support(cand, info)
        if support and support.native:
            measure.append(cand)
        else:
            why = support.reason + (f"; try {support.suggestion}" if support.suggestion else "")
            skipped.append((cand, ("not tried by tune: " if support else "") + why))
    return measure, skipped


def tune(
    workload: KerasWorkload,
    *,
    budget_s: float = 300.0,
    device: str | None = None,
    batch_size: int | None = None,
    steps: int = 4,
    warmup: int = 1,
    check_steps: int = 6,
    fix: bool = True,
    noise: float = 0.03,
    xla: bool = True,
    train_steps: int = TRAIN_STEPS,
    progress: Progress | None = None,
) -> TuneResult:
    """The fastest Keras configuration that trains like strict fp32, within ``budget_s`` seconds."""
    if not isinstance(workload, KerasWorkload):
        raise UsageError(f"mixprec.keras.tune() takes a KerasWorkload, got {type(workload).__name__}.")
    if isinstance(budget_s, bool) or not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise UsageError(f"budget must be a number of seconds > 0, got {budget_s!r}.")
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    deadline = start + budget_s
    device = str(device or backend.default_device())
    info = detect(device)
    sweep = dict(batch_size=batch_size, steps=steps, warmup=warmup, device=device)
    notes: list[str] = []

    def on_bench(event: dict[str, Any]) -> None:
        if event["event"] == "candidate":
            say(f"measuring {event['label']} ({event['index'] + 1}/{event['count']})")

    def measure(cands: list[Candidate], until: float, **extra: Any) -> BenchResult:
        return bench(workload, candidates=cands, progress=on_bench, deadline=until, **{**sweep, **extra})

    plan, skipped = tune_plan(info)
    result = measure(plan, start + SPEED_SHARE * budget_s)
    for cand, why in skipped:
        result.add(BenchRow(result.workload, cand, device, result.batch_size, Status.UNSUPPORTED, why))
    if result.stopped:
        notes.append(f"speed sweep {result.stopped}")

    verdicts: dict[Candidate, CandidateCheck] = {}
    checked: CheckResult | None = None
    checker: list[KerasChecker] = []

    def time_left() -> float:
        return deadline - RESERVE_S - time.perf_counter()

    def verify(cand: Candidate) -> CandidateCheck:
        nonlocal checked
        if not checker:
            checker.append(
                make_checker(
                    workload,
                    steps=check_steps,
                    batch_size=result.batch_size,
                    device=device,
                    progress=lambda m: say(f"checking {m}"),
                    deadline=deadline - RESERVE_S,
                )
            )
        say(f"checking numerics of {cand.label}")
        res = check(workload, policies=[cand], fix=fix, checker=checker[0])
        if checked is None:
            checked = res
        else:
            checked.candidates.extend(res.candidates)
        verdicts[cand] = res.candidates[0]
        return res.candidates[0]

    def add(rows: list[BenchRow]) -> list[BenchRow]:
        added = [r for r in rows if r.candidate != BASELINE]
        for row in added:
            result.add(row)
        return added

    # 2. numerics, fastest first
    faster = sorted(
        (r for r in result.rows if r.status == Status.OK and r.policy != "fp32" and speed(r) > 1.0),
        key=lambda r: -speed(r),
    )
    best_pass: BenchRow | None = None
    for row in faster:
        if best_pass is not None and not within_noise(
            speed(row), speed(best_pass), noise_band(row, best_pass, noise)
        ):
            break
        if time_left() <= 0:
            notes.append(f"numerics of {row.label} not checked: budget spent")
            break
        verdict = verify(row.candidate.numerics)
        if verdict.passed and (best_pass is None or speed(row) > speed(best_pass)):
            best_pass = row
        elif verdict.fix_keep_fp32 and verdict.fix_verified and time_left() > 0:
            rescued = replace(row.candidate, keep_fp32=(*row.candidate.keep_fp32, *verdict.fix_keep_fp32))
            say(f"measuring rescued {row.label} with keep_fp32={verdict.fix_keep_fp32}")
            if add(measure([rescued], deadline - RESERVE_S).measured):
                metrics: dict[str, Any] = {
                    k: v for k, v in verdict.fix_metrics.items() if k in CandidateCheck.__dataclass_fields__
                }
                verdicts[rescued.numerics] = replace(
                    verdict,
                    **metrics,
                    candidate=rescued.numerics,
                    verdict=Status.PASS,
                    reason=verdict.fix_note,
                )

    # 3. XLA on the best passing candidates
    rec, ranked = decide(result.rows, verdicts, noise=noise, train_steps=train_steps)
    if xla and rec is not None:
        passing = [
            r
            for r in result.rows
            if r.status == Status.OK
            and not r.candidate.compile
            and (r.policy == "fp32" or (verdicts.get(r.candidate.numerics) or _FAIL).passed)
        ]
        todo = [
            replace(r.candidate, compile="xla") for r in sorted(passing, key=speed, reverse=True)[:XLA_TOP]
        ]
        if todo and time_left() > 30:
            say(f"compiling {', '.join(c.label for c in todo)} with XLA")
            for row in add(measure(todo, deadline - RESERVE_S).measured):
                if row.status == Status.OK and row.policy != "fp32" and time_left() > 0:
                    verify(row.candidate.numerics)
        elif todo:
            notes.append("XLA candidates not tried: budget spent (--budget raises it)")
        rec, ranked = decide(result.rows, verdicts, noise=noise, train_steps=train_steps)
    exports: dict[str, str] = {}
    refusals: dict[str, str] = {}
    if rec is not None:
        exports["keras"] = keras_code(rec.candidate)
        refusals["pytorch"] = "a TensorFlow/Keras recommendation; the torch exports do not apply"
    return TuneResult(
        workload=result.workload,
        description=workload.description,
        device=device,
        recommendation=rec,
        ranked=ranked,
        bench=result,
        check=checked,
        lint=None,
        budget_s=budget_s,
        elapsed_s=time.perf_counter() - start,
        env=result.env,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        notes=notes,
        exports=exports,
        export_refusals=refusals,
    )


_FAIL = CandidateCheck(Candidate("fp32", framework="tensorflow"), Status.FAIL, "")
