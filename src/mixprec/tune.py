"""`tune`: the fastest policy that trains correctly, with the evidence.

1. Measure every supported policy x layout with the bench machinery (hopeless ones pruned).
2. Gate the candidates that beat strict fp32 by the numerics check, fastest first; a failing
   one may be rescued by a keep_fp32 set, which is then measured at its real cost.
3. Within measurement noise of the fastest passing candidate, prefer the simpler/safer one.
The decision itself (:func:`decide`) is a pure function of the measurements, so it is tested
on synthetic numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from mixprec import environment
from mixprec.errors import UsageError
from mixprec.hardware.device import detect, resolve_device
from mixprec.measure.results import BenchRow, Candidate, read_jsonl
from mixprec.measure.sweep import BenchResult, baseline_row, bench, set_step_times
from mixprec.numerics.check import CandidateCheck, CheckResult, check, make_checker
from mixprec.policy import POLICY_NAMES, Policy, PolicyConfig, check_support, get_policy, policy_from_config
from mixprec.workload import Workload

# Simpler/safer first: used to break ties within measurement noise. fp32 master weights beat
# half-precision storage; no loss scaling beats loss scaling; NCHW beats a layout change.
SAFETY_ORDER = ("fp32", "tf32", "bf32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true")


@dataclass
class TuneCandidate:
    label: str
    policy: str
    channels_last: bool
    keep_fp32: list[str]
    status: str  # recommended | passed | rejected | slower | pruned | unsupported | error | unchecked
    throughput: float | None = None
    speedup_vs_fp32: float | None = None
    step_time_ms: dict[str, float] | None = None
    peak_memory_bytes: int | None = None
    mfu: float | None = None
    verdict: str | None = None
    reason: str = ""


@dataclass
class Recommendation:
    label: str
    policy: str
    channels_last: bool
    keep_fp32: list[str]
    speedup_vs_fp32: float | None
    speedup_vs_tf32: float | None
    memory_saved_bytes: int | None
    margin: dict[str, float | None]
    reason: str
    tie_break: str | None = None
    tied_with: str | None = None  # the faster candidate it won against on the tie-break
    lint_worth_fixing: list[dict[str, Any]] = field(default_factory=list)

    def config(self, device: str) -> PolicyConfig:
        options: dict[str, Any] = {"channels_last": self.channels_last}
        if self.keep_fp32:
            options["keep_fp32"] = list(self.keep_fp32)
        return get_policy(self.policy, device=device, check=False, **options).config

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _safety(row: BenchRow) -> tuple[int, int, int]:
    return (SAFETY_ORDER.index(row.policy), int(row.channels_last), len(row.keep_fp32))


def _median_rel_se(row: BenchRow) -> float:
    """Relative standard error of the median step time: ~0.93 * IQR / sqrt(n) (IQR ~ 1.35 sigma,
    se(median) ~ 1.25 sigma / sqrt(n)). The IQR alone would call anything within a noisy
    candidate's spread a tie, however many steps were timed."""
    st = row.step_time_ms
    if not st or not st.median_ms or not st.n:
        return 0.0
    return 0.93 * (st.iqr_ms / st.median_ms) / math.sqrt(st.n)


def _verdict_for(
    row: BenchRow, verdicts: dict[tuple[str, tuple[str, ...]], CandidateCheck]
) -> CandidateCheck | None:
    return verdicts.get((row.policy, tuple(row.keep_fp32)))


def decide(
    rows: Sequence[BenchRow],
    verdicts: dict[tuple[str, tuple[str, ...]], CandidateCheck],
    *,
    noise: float = 0.03,
) -> tuple[Recommendation | None, list[TuneCandidate]]:
    """The fastest candidate whose numerics passed; ties within noise go to the safer one.

    ``verdicts`` maps (policy, keep_fp32) to its check; strict fp32 is the reference and
    passes by definition. ``noise`` is the smallest relative throughput difference treated
    as real; a larger standard error of the two median step times widens it.
    """
    measured = [r for r in rows if not r.baseline_repeat]
    fp32 = baseline_row(measured)
    tf32 = max(
        (r for r in measured if r.policy == "tf32" and r.status == "ok"),
        key=lambda r: r.throughput or 0,
        default=None,
    )
    passing: list[BenchRow] = []
    table: list[TuneCandidate] = []
    for row in measured:
        cand = TuneCandidate(
            row.label,
            row.policy,
            row.channels_last,
            list(row.keep_fp32),
            row.status,
            row.throughput,
            row.speedup_vs_fp32,
            row.step_time_ms.to_dict() if row.step_time_ms else None,
            row.peak_memory_bytes,
            row.mfu,
            reason=row.reason,
        )
        table.append(cand)
        if row.status != "ok":
            continue
        verdict = _verdict_for(row, verdicts)
        if row.policy == "fp32":
            cand.verdict, cand.status = "pass", "passed"
            cand.reason = (
                "the strict fp32 reference" if not row.channels_last else "fp32 numerics (layout only)"
            )
            passing.append(row)
        elif verdict is None:
            slower = fp32 is not None and (row.throughput or 0) <= (fp32.throughput or 0)
            cand.status = "slower" if slower else "unchecked"
            cand.reason = (
                "not faster than strict fp32"
                if slower
                else "numerics not checked: a faster candidate passed first, or the budget ran out"
            )
        else:
            cand.verdict, cand.reason = verdict.verdict, verdict.reason
            cand.status = "passed" if verdict.verdict == "pass" else "rejected"
            if verdict.verdict == "pass":
                passing.append(row)
    if not passing:
        return None, table
    fastest = max(passing, key=lambda r: r.throughput or 0.0)
    band = [
        r
        for r in passing
        if _within_noise(r.throughput or 0, fastest.throughput or 0, _noise_band(r, fastest, noise))
    ]
    chosen = min(band, key=_safety)
    tie_break = None
    if chosen is not fastest:
        gap = 1 - (chosen.throughput or 0) / (fastest.throughput or 1)
        tie_break = (
            f"{fastest.label} measured {gap:.1%} faster than {chosen.label}, within measurement noise; "
            f"{chosen.label} is simpler/safer, so it is preferred"
        )
    for cand in table:
        if cand.label == chosen.label:
            cand.status = "recommended"
    verdict = _verdict_for(chosen, verdicts)
    # The figures with the limits that were applied to them (SQNR floors and the loss allowance
    # adapt to how much this model amplifies noise, see docs/check.md).
    margin = {
        "output_sqnr_db": verdict.output_sqnr_db if verdict else None,
        "output_sqnr_db_limit": verdict.required_output_sqnr_db if verdict else None,
        "grad_sqnr_db": verdict.total_grad_sqnr_db if verdict else None,
        "grad_sqnr_db_limit": verdict.required_grad_sqnr_db if verdict else None,
        "max_rel_loss_diff": verdict.max_rel_loss_diff if verdict else None,
        "max_rel_loss_diff_limit": verdict.allowed_rel_loss_diff if verdict else None,
    }
    saved = None
    if fp32 and fp32.peak_memory_bytes and chosen.peak_memory_bytes:
        saved = fp32.peak_memory_bytes - chosen.peak_memory_bytes
    rec = Recommendation(
        label=chosen.label,
        policy=chosen.policy,
        channels_last=chosen.channels_last,
        keep_fp32=list(chosen.keep_fp32),
        speedup_vs_fp32=chosen.speedup_vs_fp32,
        speedup_vs_tf32=(chosen.throughput / tf32.throughput)
        if tf32 and tf32.throughput and chosen.throughput
        else None,
        memory_saved_bytes=saved,
        margin=margin,
        reason=_reason(chosen, table, verdict, tie_break),
        tie_break=tie_break,
        tied_with=fastest.label if tie_break else None,
    )
    return rec, table


def _reason(
    chosen: BenchRow, table: list[TuneCandidate], verdict: CandidateCheck | None, tie: str | None
) -> str:
    parts = []
    for cand in table:
        if cand.status == "rejected":
            parts.append(f"{cand.label} rejected: {cand.reason}")
    pruned = [c.label for c in table if c.status == "pruned"]
    if pruned:
        parts.append(f"{', '.join(pruned)} pruned as far slower than the best")
    speed = f"{chosen.speedup_vs_fp32:.2f}x faster than strict fp32" if chosen.speedup_vs_fp32 else "measured"
    if chosen.policy == "fp32":
        parts.append(
            "no lower-precision candidate both beat strict fp32 and passed the numerics check: stay in fp32"
        )
    else:
        match = ""
        if verdict is not None and verdict.max_rel_loss_diff is not None:
            match = f" and matches its loss within {verdict.max_rel_loss_diff:.2%} over the checked steps"
        islands = f" with {', '.join(chosen.keep_fp32)} kept in fp32" if chosen.keep_fp32 else ""
        parts.append(f"{chosen.label}{islands} is {speed}{match}")
    if tie:
        parts.append(tie)
    return "; ".join(parts) + "."


@dataclass
class TuneResult:
    workload: str
    description: str
    device: str
    recommendation: Recommendation | None
    candidates: list[TuneCandidate]
    bench: BenchResult
    check: CheckResult | None
    lint: list[dict[str, Any]] | None
    budget_s: float
    elapsed_s: float
    env: dict[str, Any]
    created: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        from mixprec.export import export_all

        rec = self.recommendation
        return {
            "workload": self.workload,
            "description": self.description,
            "device": self.device,
            "created": self.created,
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s,
            "notes": self.notes,
            "bench": self.bench.to_dict(),
            "check": self.check.to_dict() if self.check else None,
            "lint": {"findings": self.lint} if self.lint is not None else None,
            "candidates": [asdict(c) for c in self.candidates],
            "recommendation": rec.to_dict() if rec else None,
            "exports": export_all(rec.config(self.device)) if rec else {},
        }


Progress = Callable[[str], None]


class _OutOfBudget(Exception):
    pass


def _candidates(info: Any, has_4d: bool) -> list[Candidate]:
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
    """Find the fastest policy that trains like fp32 on ``workload`` within ``budget_s`` seconds."""
    if not isinstance(workload, Workload):
        raise UsageError(f"tune() takes a mixprec.Workload, got {type(workload).__name__}.")
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise UsageError(f"budget must be a number of seconds > 0, got {budget_s!r}.")
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    deadline = start + budget_s
    dev = resolve_device(device)
    info = detect(dev)
    has_4d = any(p.dim() == 4 for p in workload.model.parameters())
    notes: list[str] = []

    # 1. speed: the bench sweep, stopped (rows kept) when ~60% of the budget is spent.
    speed_deadline = start + 0.6 * budget_s

    def on_bench(event: dict[str, Any]) -> None:
        if event["event"] == "candidate":
            say(f"measuring {event['label']} ({event['index'] + 1}/{event['count']})")
        if event["event"] in ("candidate", "step") and time.perf_counter() > speed_deadline:
            raise _OutOfBudget

    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "rows.jsonl"
        kwargs = dict(batch_size=batch_size, steps=steps, warmup=warmup, device=dev, jsonl=jsonl)
        try:
            result = bench(workload, candidates=_candidates(info, has_4d), progress=on_bench, **kwargs)
        except _OutOfBudget:
            rows = read_jsonl(jsonl)
            notes.append(f"speed sweep stopped by the budget after {len(rows)} candidates")
            result = BenchResult(
                workload=rows[0].workload if rows else str(workload.name),
                description=workload.description,
                device=str(dev),
                batch_size=rows[0].batch_size if rows else (batch_size or 0),
                settings={},
                rows=rows,
                env=environment.collect(dev),
            )

        fp32 = result.baseline
        faster = sorted(
            (
                r
                for r in result.rows
                if r.status == "ok"
                and not r.baseline_repeat
                and r.policy != "fp32"
                and fp32 is not None
                and (r.throughput or 0) > (fp32.throughput or 0)
            ),
            key=lambda r: -(r.throughput or 0),
        )
        # 2. numerics, fastest policy first; stop once one passes and nothing faster is left
        #    within noise of it.
        verdicts: dict[tuple[str, tuple[str, ...]], CandidateCheck] = {}
        checked: CheckResult | None = None
        checker = None  # one fp32 reference + chaos floor shared by every policy checked
        order = list(dict.fromkeys(r.policy for r in faster))
        best_pass: BenchRow | None = None
        for policy in order:
            top = max((r for r in faster if r.policy == policy), key=lambda r: r.throughput or 0)
            if best_pass is not None and not _within_noise(
                top.throughput or 0, best_pass.throughput or 0, _noise_band(top, best_pass, noise)
            ):
                break  # slower than a passing candidate by more than the noise: cannot win
            if time.perf_counter() > deadline - 10:
                notes.append(f"numerics of {policy} not checked: budget spent")
                break
            say(f"checking numerics of {policy}")
            if checker is None:
                checker = make_checker(
                    workload,
                    steps=check_steps,
                    batch_size=batch_size,
                    device=dev,
                    progress=lambda m: say(f"checking {m}"),
                    deadline=deadline - 10,
                )
            res = check(workload, policies=[policy], fix=fix, checker=checker)
            cand = res.candidates[0]
            verdicts[(policy, ())] = cand
            checked = res if checked is None else _merge_checks(checked, res)
            if cand.verdict == "pass" and (
                best_pass is None or (top.throughput or 0) > (best_pass.throughput or 0)
            ):
                best_pass = top
            elif cand.keep_fp32 and cand.fix_verified and time.perf_counter() < deadline - 10:
                verdicts.update(
                    _measure_rescue(workload, result, faster, cand, policy, kwargs, tmp, deadline, say)
                )
    rec, table = decide(result.rows, verdicts, noise=noise)
    # A tie within noise leaves the answer open: spend what is left of the budget re-measuring it.
    if (
        rec is not None
        and rec.tied_with
        and _remeasure_tie(workload, result, rec, kwargs, deadline, say, notes)
    ):
        rec, table = decide(result.rows, verdicts, noise=noise)
    findings = None
    if lint and rec is not None and time.perf_counter() < deadline:
        findings = _lint(workload, rec, dev, notes)
        if findings:
            rec.lint_worth_fixing = [f for f in findings if f.get("severity") in ("warning", "error")][:5]
    return TuneResult(
        workload=result.workload,
        description=workload.description,
        device=str(dev),
        recommendation=rec,
        candidates=table,
        bench=result,
        check=checked,
        lint=findings,
        budget_s=budget_s,
        elapsed_s=time.perf_counter() - start,
        env=result.env or environment.collect(dev),
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        notes=notes,
    )


def _noise_band(a: BenchRow, b: BenchRow, noise: float) -> float:
    """Relative throughput difference that is not real: ``noise``, or the combined standard
    error of the two median step times if larger."""
    return max(noise, math.hypot(_median_rel_se(a), _median_rel_se(b)))


def _within_noise(throughput: float, best: float, noise: float) -> bool:
    return throughput >= best * (1 - noise)


def _measure_rescue(
    workload: Workload,
    result: BenchResult,
    faster: list[BenchRow],
    cand: CandidateCheck,
    policy: str,
    kwargs: dict[str, Any],
    tmp: str,
    deadline: float,
    say: Progress,
) -> dict[tuple[str, tuple[str, ...]], CandidateCheck]:
    """Measure a failing policy rescued by keep_fp32 (fp32 islands are not free) and return its
    verdict, built from the verifying run's figures."""
    layouts = sorted({r.channels_last for r in faster if r.policy == policy})
    rescued = [Candidate(policy, cl, tuple(cand.keep_fp32)) for cl in layouts]
    say(f"measuring rescued {policy} with keep_fp32={cand.keep_fp32}")

    def on_rescue(event: dict[str, Any]) -> None:
        if event["event"] in ("candidate", "step") and time.perf_counter() > deadline:
            raise _OutOfBudget

    try:
        # bench always measures fp32 first; the rows are re-based on the sweep's own baseline below
        extra = bench(
            workload,
            candidates=rescued,
            repeat_baseline=False,
            progress=on_rescue,
            **{**kwargs, "jsonl": Path(tmp) / "rescued.jsonl"},
        )
    except _OutOfBudget:
        result.notes.append(f"rescued {policy} not measured: budget spent")
        return {}
    base = result.baseline
    for row in extra.rows:
        if row.keep_fp32:
            if base and base.throughput and row.throughput:
                row.speedup_vs_fp32 = row.throughput / base.throughput
            result.rows.append(row)
    metrics = {k: v for k, v in cand.fix_metrics.items() if k in CandidateCheck.__dataclass_fields__}
    fixed = CandidateCheck(**{**asdict(cand), **metrics, "verdict": "pass", "reason": cand.fix_note})
    return {(policy, tuple(cand.keep_fp32)): fixed}


def _remeasure_tie(
    workload: Workload,
    result: BenchResult,
    rec: Recommendation,
    kwargs: dict[str, Any],
    deadline: float,
    say: Progress,
    notes: list[str],
) -> bool:
    """Time the recommended row and the faster one it tied with again, twice as long, and fold
    the new step times into both rows. False when the budget cannot pay for it."""
    rows = {r.label: r for r in result.rows if r.status == "ok" and not r.baseline_repeat}
    chosen, rival = rows[rec.label], rows[rec.tied_with]  # type: ignore[index]
    steps = 2 * kwargs["steps"]
    cost = sum(
        (kwargs["warmup"] + steps) * (r.step_time_ms.median_ms / 1e3)
        for r in (chosen, rival)
        if r.step_time_ms
    )
    # fp32 is measured first by bench as well: pay for it too
    base = result.baseline
    cost += (
        (kwargs["warmup"] + steps) * (base.step_time_ms.median_ms / 1e3) if base and base.step_time_ms else 0
    )
    if time.perf_counter() + 1.5 * cost > deadline:
        notes.append(f"{chosen.label} and {rival.label} tie within noise; no budget left to re-measure them")
        return False
    say(f"re-measuring {chosen.label} and {rival.label}: within noise of each other")

    def on_event(event: dict[str, Any]) -> None:
        if event["event"] in ("candidate", "step") and time.perf_counter() > deadline:
            raise _OutOfBudget

    with tempfile.TemporaryDirectory() as tmp:
        try:
            again = bench(
                workload,
                candidates=[chosen.candidate, rival.candidate],
                repeat_baseline=False,
                progress=on_event,
                **{**kwargs, "steps": steps, "jsonl": Path(tmp) / "tie.jsonl"},
            )
        except _OutOfBudget:
            notes.append("re-measurement of the tie stopped by the budget")
            return False
    by_label = {r.label: r for r in again.rows if r.status == "ok"}
    for row in (chosen, rival):
        extra = by_label.get(row.label)
        if extra is None:
            continue
        merged = row.step_times_ms + extra.step_times_ms
        set_step_times(row, merged, base)
    notes.append(
        f"{chosen.label} and {rival.label} were within noise: re-measured with {steps} more steps each"
    )
    return True


def _merge_checks(a: CheckResult, b: CheckResult) -> CheckResult:
    a.candidates.extend(b.candidates)
    return a


def _lint(
    workload: Workload, rec: Recommendation, device: torch.device, notes: list[str]
) -> list[dict] | None:
    try:
        from mixprec.lint import lint as run_lint
    except ImportError:  # pragma: no cover - lint ships with mixprec; this guards partial installs
        return None
    try:
        findings = run_lint(workload, policy=rec.policy, device=device)
    except Exception as exc:  # lint is advice: its failure must not lose the recommendation
        notes.append(f"lint failed: {type(exc).__name__}: {exc}")
        return None
    return [f.to_dict() if hasattr(f, "to_dict") else asdict(f) for f in findings]


def _cache_file() -> Path:
    import os

    return Path(os.environ.get("MIXPREC_CACHE_DIR", "~/.cache/mixprec")).expanduser() / "autotune.json"


def autotune_key(workload: Workload, device: torch.device, batch_size: int | None) -> str:
    """What the decision depends on: the model's shapes, the device, the batch, the versions."""
    from mixprec import __version__

    shapes = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in workload.model.named_parameters())
    payload = "|".join(
        [
            str(workload.name),
            str(workload.spec.to_dict() if workload.spec else None),
            hashlib.sha256(shapes.encode()).hexdigest()[:16],
            detect(device).name,
            str(batch_size or workload.default_batch_size),
            torch.__version__,
            __version__,
        ]
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def autotune(
    workload: Workload,
    *,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    cache_path: str | Path | None = None,
    refresh: bool = False,
    **tune_options: Any,
) -> Policy:
    """The recommended policy for ``workload``, tuned once and then read from a cache file.

    The cache (``~/.cache/mixprec/autotune.json`` or ``$MIXPREC_CACHE_DIR``) is keyed by the
    model's parameter shapes, the device, the batch size and the torch/mixprec versions, so a
    changed model or machine is tuned again. ``refresh=True`` ignores the cached decision.
    """
    dev = resolve_device(device)
    path = Path(cache_path) if cache_path else _cache_file()
    key = autotune_key(workload, dev, batch_size)
    try:
        cache = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        cache = {}  # a corrupt cache is a miss, not an error
    if not refresh and key in cache:
        return policy_from_config(cache[key]["config"])
    result = tune(workload, device=dev, batch_size=batch_size, **tune_options)
    rec = result.recommendation
    config = rec.config(str(dev)) if rec else get_policy("fp32", device=dev).config
    cache[key] = {
        "config": config.to_dict(),
        "workload": result.workload,
        "reason": rec.reason if rec else "nothing passed: fp32",
        "created": result.created,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=2), encoding="utf-8")
    tmp.replace(path)
    return policy_from_config(config)
