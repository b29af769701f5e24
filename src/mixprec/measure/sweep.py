"""The sweep: every candidate policy on the same workload, weights, batches and batch size.

Strict fp32 runs first (the baseline every speedup refers to) and again at the end so drift
shows. Each finished row is appended to a JSON Lines file at once; ``resume`` skips the rows
already there. A candidate whose steps are far slower than the best so far is pruned.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec import environment
from mixprec.errors import PolicyError, UsageError
from mixprec.hardware.device import detect, resolve_device
from mixprec.hardware.peaks import peak_flops
from mixprec.measure import flops as flops_mod
from mixprec.measure.isolate import run_isolated
from mixprec.measure.results import BenchRow, Candidate, StepTime, append_jsonl, read_jsonl
from mixprec.measure.runner import BenchSettings, Measurement, distinct_batches, make_batches, run_candidate
from mixprec.policy.registry import POLICY_NAMES, canonical_name, check_support
from mixprec.workload import Workload

Progress = Callable[[dict[str, Any]], None]
CHANNELS_LAST_CHOICES = ("off", "on", "both")
_CUDA_WARMUP_LIMIT_S = 600.0


@dataclass
class BenchResult:
    workload: str
    description: str
    device: str
    batch_size: int
    settings: dict[str, Any]
    rows: list[BenchRow] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> BenchRow | None:
        return baseline_row(self.rows)

    @property
    def baseline_drift(self) -> float | None:
        """Relative change of the fp32 step time between the start and the end of the sweep."""
        first = self.baseline
        repeat = next((r for r in self.rows if r.baseline_repeat and r.status == "ok"), None)
        if not first or not repeat or not first.step_time_ms or not repeat.step_time_ms:
            return None
        return repeat.step_time_ms.median_ms / first.step_time_ms.median_ms - 1.0

    def best(self) -> BenchRow | None:
        ok = [r for r in self.rows if r.status == "ok" and r.throughput and not r.baseline_repeat]
        return max(ok, key=lambda r: r.throughput or 0.0, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "description": self.description,
            "device": self.device,
            "batch_size": self.batch_size,
            "settings": self.settings,
            "baseline_drift": self.baseline_drift,
            "notes": self.notes,
            "rows": [r.to_dict() for r in self.rows],
        }


def parse_policies(policies: str | Sequence[str] | None) -> list[str]:
    """'all', a comma-separated string or a list of names/aliases -> canonical names, in order."""
    if policies is None or policies == "all" or policies == ["all"]:
        return list(POLICY_NAMES)
    items = policies.split(",") if isinstance(policies, str) else list(policies)
    names: list[str] = []
    for item in items:
        name = canonical_name(item.strip())
        if name not in names:
            names.append(name)
    if not names:
        raise PolicyError(
            f"No policy given; valid: all, or a comma-separated list of {', '.join(POLICY_NAMES)}."
        )
    return names


def parse_channels_last(value: str | bool) -> list[bool]:
    if isinstance(value, bool):
        return [value]
    mapping = {"off": [False], "on": [True], "both": [False, True]}
    if value not in mapping:
        raise UsageError(f"Invalid channels_last {value!r}; valid: {', '.join(CHANNELS_LAST_CHOICES)}.")
    return mapping[value]


def workload_label(workload: Workload) -> str:
    sizes = dict(workload.spec.sizes) if workload.spec else {}
    inner = ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))
    return f"{workload.name}({inner})" if inner else str(workload.name)


def _has_4d_weights(model: torch.nn.Module) -> bool:
    return any(p.dim() == 4 for p in model.parameters())


def plan_candidates(policies: Iterable[str], layouts: Iterable[bool]) -> list[Candidate]:
    """Strict fp32 NCHW first (the baseline), then the rest in vocabulary order."""
    layouts = list(layouts)
    cands = [Candidate(p, cl) for p in policies for cl in layouts]
    baseline = Candidate("fp32", False)
    rest = [c for c in cands if c != baseline]
    return [baseline, *rest]


def baseline_row(rows: Iterable[BenchRow]) -> BenchRow | None:
    """The strict-fp32 NCHW row measured first: what every speedup refers to."""
    return next(
        (
            r
            for r in rows
            if r.policy == "fp32" and not r.channels_last and not r.baseline_repeat and r.status == "ok"
        ),
        None,
    )


def set_step_times(row: BenchRow, step_ms: list[float], baseline: BenchRow | None = None) -> None:
    """Median, IQR, n and throughput from the timed steps (ms); the speedup too when a baseline is given."""
    q = statistics.quantiles(step_ms, n=4) if len(step_ms) >= 2 else [step_ms[0]] * 3
    row.step_times_ms = step_ms
    row.step_time_ms = StepTime(statistics.median(step_ms), q[2] - q[0], len(step_ms))
    row.throughput = row.batch_size / (row.step_time_ms.median_ms / 1e3)
    if baseline is not None and baseline.throughput:
        row.speedup_vs_fp32 = row.throughput / baseline.throughput


def _derive(row: BenchRow, m: Measurement | None, timed: list[float]) -> None:
    """Fill the figures that follow from the step times (seconds) and the measurement."""
    if timed:
        set_step_times(row, [t * 1e3 for t in timed])
    if m is not None:
        row.first_loss = m.first_loss
        row.observed_dtype = m.observed_dtype
        row.peak_memory_bytes = m.peak_memory_bytes
        row.memory_method = m.memory_method


def _finish(rows: list[BenchRow], info: Any, flops: int | None) -> None:
    """Speedups against the fp32 baseline, FLOPs, achieved TFLOP/s and MFU for every timed row."""
    baseline = baseline_row(rows)
    for row in rows:
        if row.throughput and baseline and baseline.throughput:
            row.speedup_vs_fp32 = row.throughput / baseline.throughput
        if row.step_time_ms is None:
            continue
        row.flops_per_step = flops
        step_s = row.step_time_ms.median_ms / 1e3
        row.achieved_tflops = flops_mod.achieved_tflops(flops, step_s)
        peak, source = peak_flops(info, row.policy)
        row.peak_flops, row.peak_flops_source = peak, source
        row.mfu = flops_mod.mfu(flops, step_s, peak)


def bench(
    workload: Workload,
    *,
    policies: str | Sequence[str] | None = "all",
    channels_last: str | bool = "both",
    batch_size: int | None = None,
    steps: int = 10,
    warmup: int = 2,
    min_time_s: float = 0.0,
    device: str | torch.device | None = None,
    jsonl: str | Path | None = None,
    resume: bool = False,
    isolate: bool | None = None,
    prune_factor: float = 5.0,
    repeat_baseline: bool = True,
    progress: Progress | None = None,
    candidates: Sequence[Candidate] | None = None,
    nproc: int = 1,
    cudnn_benchmark: bool = True,
) -> BenchResult:
    """Measure every candidate policy on ``workload``'s real training step.

    ``candidates`` (e.g. a policy with a ``keep_fp32`` rescue) replaces the grid of
    ``policies`` x ``channels_last``; strict fp32 is always measured first. ``nproc > 1``
    trains every candidate data-parallel on that many DDP ranks (``batch_size`` per rank)
    and reports global throughput and the per-rank spread; it needs a workload spec.
    ``cudnn_benchmark`` lets cuDNN autotune its convolution algorithms on CUDA (warm-up
    steps absorb the tuning), as NVIDIA's and timm's training scripts do.

    ``isolate`` (default: when the workload has a spec) runs each candidate in its own
    process, which gives isolated CPU peak memory and survives crashes. ``prune_factor``:
    a candidate slower than that many times the best step time so far is stopped.
    """
    if not isinstance(workload, Workload):
        raise UsageError(f"bench() takes a mixprec.Workload, got {type(workload).__name__}.")
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 1)):
        if not isinstance(value, int) or value < low:
            raise UsageError(f"{name} must be an integer >= {low}, got {value!r}.")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise UsageError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    if not (isinstance(min_time_s, (int, float)) and 0 <= min_time_s < math.inf):
        raise UsageError(f"min_time_s must be a finite number of seconds >= 0, got {min_time_s!r}.")
    if not (isinstance(prune_factor, (int, float)) and prune_factor > 1):
        raise UsageError(f"prune_factor must be a number > 1, got {prune_factor!r}.")
    dev = resolve_device(device)
    info = detect(dev)
    names = parse_policies(policies)
    if "fp32" not in names:
        names.insert(0, "fp32")  # speedups need the strict baseline
    layouts = parse_channels_last(channels_last)
    has_4d = _has_4d_weights(workload.model)
    notes = []
    if True in layouts and not has_4d:
        layouts = [False]
        notes.append(
            "channels_last candidates skipped: the model has no 4-D (conv) weights, so it changes nothing"
        )
    if not isinstance(nproc, int) or nproc < 1:
        raise UsageError(f"nproc must be an integer >= 1, got {nproc!r}.")
    if nproc > 1 and workload.spec is None:
        raise UsageError("nproc > 1 needs a workload with a spec (built by load_workload or the zoo).")
    isolate = workload.spec is not None if isolate is None else isolate
    if isolate and workload.spec is None:
        raise UsageError("isolate=True needs a workload with a spec (built by load_workload or the zoo).")
    progress = progress or (lambda event: None)
    label = workload_label(workload)
    bs = batch_size or workload.default_batch_size
    result = BenchResult(
        workload=label,
        description=workload.description,
        device=str(dev),
        batch_size=bs,
        settings={
            "steps": steps,
            "warmup": warmup,
            "prune_factor": prune_factor,
            "isolate": isolate,
            "policies": names,
            "nproc": nproc,
            "channels_last": channels_last,
            "threads": torch.get_num_threads(),
            "min_time_s": min_time_s,
            "cudnn_benchmark": cudnn_benchmark and dev.type == "cuda",
        },
        env=environment.collect(dev),
        notes=notes,
    )
    done: dict[tuple, BenchRow] = {}
    if jsonl is not None:
        if resume:
            # errors and OOMs may be transient: only finished verdicts are kept, the rest re-run
            done = {r.key: r for r in read_jsonl(jsonl) if r.status in ("ok", "unsupported", "pruned")}
        else:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            Path(jsonl).write_text("", encoding="utf-8")

    plan = plan_candidates(names, layouts) if candidates is None else plan_candidates([], [])
    plan += [c for c in (candidates or []) if c not in plan]
    if repeat_baseline:
        plan.append(Candidate("fp32", False))
    shared_batches: list | None = None  # in-process runs: one set of batches for all candidates
    flops: int | None = next((r.flops_per_step for r in done.values() if r.flops_per_step), None)

    for index, cand in enumerate(plan):
        is_repeat = repeat_baseline and index == len(plan) - 1
        row = BenchRow(
            label,
            cand.policy,
            cand.channels_last,
            str(dev),
            bs,
            "ok",
            baseline_repeat=is_repeat,
            keep_fp32=list(cand.keep_fp32),
        )
        if row.key in done:
            result.rows.append(done[row.key])
            progress(
                {"event": "row", "row": done[row.key], "index": index, "count": len(plan), "resumed": True}
            )
            continue
        progress({"event": "candidate", "label": row.label, "index": index, "count": len(plan)})
        support = check_support(cand.policy, info)
        if not support:
            row.status = "unsupported"
            row.reason = support.reason + (f"; try {support.suggestion}" if support.suggestion else "")
        else:
            ok_rows = [
                r for r in result.rows if r.status == "ok" and r.step_time_ms and not r.baseline_repeat
            ]
            settings = BenchSettings(
                device=str(dev),
                batch_size=bs,
                steps=steps,
                warmup=warmup,
                count_flops=flops is None,
                threads=torch.get_num_threads(),
                min_time_s=min_time_s,
                cudnn_benchmark=cudnn_benchmark,
            )
            if nproc > 1:
                _measure_data_parallel(row, workload, cand, settings, nproc)
            else:
                if not isolate and shared_batches is None:
                    try:
                        shared_batches = make_batches(
                            workload, bs, dev, settings.seed, distinct_batches(settings)
                        )
                    except Exception as exc:  # e.g. a batch larger than the device: this row's failure
                        row.status, row.reason = _failure(exc)
                if row.status == "ok":
                    _measure(
                        row,
                        workload,
                        cand,
                        settings,
                        isolate,
                        prune_factor,
                        ok_rows,
                        progress,
                        shared_batches,
                    )
            if row.status == "ok" and flops is None and row.flops_per_step:
                flops = row.flops_per_step
        _finish([*result.rows, row], info, flops)
        result.rows.append(row)
        if jsonl is not None:
            append_jsonl(jsonl, row)
        progress({"event": "row", "row": row, "index": index, "count": len(plan), "resumed": False})
    _finish(result.rows, info, flops)
    return result


def _measure_data_parallel(
    row: BenchRow, workload: Workload, cand: Candidate, settings: BenchSettings, nproc: int
) -> None:
    """Fill ``row`` from a DDP run on ``nproc`` ranks (no pruning: every rank must finish)."""
    from mixprec.measure.data_parallel import rank_medians_ms, run_data_parallel, slowest_rank_step_times

    wall = time.perf_counter()
    outcome = run_data_parallel(workload.spec, cand, settings, nproc)  # type: ignore[arg-type]
    row.wall_s = time.perf_counter() - wall
    row.world_size = nproc
    if outcome.status != "ok" or not outcome.ranks:
        row.status, row.reason = "oom" if "OutOfMemory" in outcome.reason else "error", outcome.reason
        return
    ranks = outcome.ranks
    _derive(row, ranks[0], slowest_rank_step_times(ranks))
    if row.throughput:
        row.throughput *= nproc  # every rank trains on its own batch of batch_size samples
    row.flops_per_step = ranks[0].flops_per_step  # per rank: MFU stays per device
    row.rank_step_time_ms = rank_medians_ms(ranks)
    row.rank_peak_memory_bytes = [m.peak_memory_bytes for m in ranks]
    known = [b for b in row.rank_peak_memory_bytes if b is not None]
    row.peak_memory_bytes = max(known) if known else None
    row.memory_method = (ranks[0].memory_method + " (the largest rank)") if known else "n/a"


def _failure(exc: BaseException) -> tuple[str, str]:
    """(status, reason) of a candidate that raised: 'oom' for out-of-memory, else 'error'."""
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if isinstance(exc, torch.OutOfMemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the memory back before the next candidate
        return "oom", reason
    return "error", reason


def _measure(
    row: BenchRow,
    workload: Workload,
    cand: Candidate,
    settings: BenchSettings,
    isolate: bool,
    prune_factor: float,
    ok_rows: list[BenchRow],
    progress: Progress,
    batches: list | None,
) -> None:
    """Run one candidate and fill ``row``: status, reason, timings, memory."""
    best_median_s = min((r.step_time_ms.median_ms / 1e3 for r in ok_rows if r.step_time_ms), default=None)
    # A cold first step (allocation, kernel selection, CUDA context) is judged against the best
    # candidate's own cold first step, later steps against its median.
    best_first_s = min((r.first_step_ms / 1e3 for r in ok_rows if r.first_step_ms), default=None)
    # Below a second a "hopeless" verdict is process noise, not a measurement.
    floor_s = 1.0

    on_cuda = settings.device.startswith("cuda")

    def step_timeout(i: int) -> float | None:
        if best_median_s is None:
            return None
        if on_cuda and i < settings.warmup:
            # cuDNN autotuning and lazy kernel loading make CUDA warm-up steps cost what the dtype and
            # layout happen to need (8 to 69 s for ResNet-50 at batch 256 on an H100), unrelated to the
            # steady-state speed: never pruned there, only bounded.
            return _CUDA_WARMUP_LIMIT_S
        if i == 0 and best_first_s:
            return max(floor_s, prune_factor * best_first_s)  # cold step vs the best's cold step
        if i < settings.warmup:  # later warm-up steps may still be settling: a wider margin
            return max(floor_s, prune_factor * 3 * best_median_s)
        return max(floor_s, prune_factor * best_median_s)

    timed: list[float] = []
    seen: list[float] = []
    verdict: dict[str, str] = {}
    first_loss: dict[str, float | None] = {"value": None}

    def on_event(event: dict[str, Any]) -> bool:
        if event.get("event") != "step":
            return True
        seen.append(event["seconds"])
        if event["index"] == 0:
            first_loss["value"] = event.get("loss")
            row.first_step_ms = event["seconds"] * 1e3
        if event["timed"]:
            timed.append(event["seconds"])
        progress({**event, "label": row.label})
        limit = step_timeout(event["index"])
        if limit is not None and event["seconds"] > limit:
            verdict["reason"] = (
                f"step {event['index']} took {event['seconds'] * 1e3:.0f} ms, over {prune_factor:g}x the "
                f"best step time so far ({best_median_s * 1e3:.0f} ms)"  # type: ignore[operator]
            )
            return False
        return True

    measurement: Measurement | None = None
    wall = time.perf_counter()
    if isolate:
        outcome = run_isolated(workload.spec, cand, settings, step_timeout=step_timeout, on_event=on_event)  # type: ignore[arg-type]
        row.status, measurement = outcome.status, outcome.measurement
        row.reason = verdict.get("reason") or outcome.reason
        if outcome.status == "pruned" and not verdict and best_median_s:
            limit = step_timeout(len(outcome.steps_seen or []))
            row.reason += (
                f" (best so far {best_median_s * 1e3:.0f} ms/step: "
                f"at least {(limit or 0) / best_median_s:.0f}x slower)"
            )
        if measurement is not None:
            row.flops_per_step = measurement.flops_per_step
    else:
        try:
            measurement = run_candidate(workload, cand, settings, on_event, batches)
            row.flops_per_step = measurement.flops_per_step
            if measurement.stopped_early:
                row.status, row.reason = "pruned", verdict.get("reason", "stopped early")
        except Exception as exc:  # any failure of one candidate must not stop the sweep
            row.status, row.reason = _failure(exc)
    row.wall_s = time.perf_counter() - wall
    if row.status == "pruned":
        # Keep the measured figure: the steps that did complete (timed ones if any, else warm-up).
        figures = timed or seen
        _derive(row, measurement, figures)
        row.first_loss = first_loss["value"]
        if not figures:
            row.reason = row.reason or "pruned before its first step finished"
        return
    if row.status != "ok":
        return
    _derive(row, measurement, measurement.step_times_s if measurement else timed)
    if row.peak_memory_bytes is None:
        row.memory_method = "n/a: in-process run (isolated CPU memory needs a workload spec)"
    if row.first_loss is not None and not math.isfinite(row.first_loss):
        row.status, row.reason = "error", f"non-finite first loss {row.first_loss}"
