"""The sweep: every candidate on the same workload, weights, batches and batch size.

Strict fp32 runs first (the baseline every speedup refers to) and again at the end so drift
shows. Each finished row is appended to a JSON Lines file at once; ``resume`` skips the rows
already there. A candidate whose steps are far slower than the best so far is pruned. A
``deadline`` or ``should_stop`` ends the sweep early: it returns the rows measured so far.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import PolicyError, UsageError
from mixprec.hardware import environment
from mixprec.hardware.device import DeviceInfo, detect, resolve_device
from mixprec.hardware.peaks import peak_flops
from mixprec.measure.isolate import run_isolated
from mixprec.measure.results import BenchResult, BenchRow, Peaks, append_jsonl, read_jsonl
from mixprec.measure.runner import BenchSettings, Measurement, distinct_batches, make_batches, run_candidate
from mixprec.policy import POLICY_NAMES, Candidate, canonical_name, check_support
from mixprec.status import Status
from mixprec.workload import Workload

Progress = Callable[[dict[str, Any]], None]
CHANNELS_LAST_CHOICES = ("off", "on", "both")
_CUDA_WARMUP_LIMIT_S = 600.0
BASELINE = Candidate("fp32")


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


def has_4d_weights(model: torch.nn.Module) -> bool:
    return any(p.dim() == 4 for p in model.parameters())


def plan_candidates(policies: Iterable[str], layouts: Iterable[bool]) -> list[Candidate]:
    """Strict fp32 NCHW first (the baseline), then the rest in vocabulary order."""
    layouts = list(layouts)
    cands = [Candidate(p, cl) for p in policies for cl in layouts]
    return [BASELINE, *[c for c in cands if c != BASELINE]]


def _peaks(info: DeviceInfo, plan: Iterable[Candidate]) -> Peaks:
    keys = dict.fromkeys(c.spec.peak_key for c in plan)
    return {key: peak_flops(info, key) for key in keys}


def _validate(
    steps: int, warmup: int, batch_size: int | None, min_time_s: float, prune_factor: float
) -> None:
    for name, value in (("steps", steps), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}.")
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise UsageError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    if not (isinstance(min_time_s, (int, float)) and 0 <= min_time_s < math.inf):
        raise UsageError(f"min_time_s must be a finite number of seconds >= 0, got {min_time_s!r}.")
    if not (isinstance(prune_factor, (int, float)) and prune_factor > 1):
        raise UsageError(f"prune_factor must be a number > 1, got {prune_factor!r}.")


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
    deadline: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> BenchResult:
    """Measure every candidate policy on ``workload``'s real training step.

    Args:
        workload: the model, its batches, loss and optimizer.
        policies: 'all', or policy names (a list or a comma-separated string).
        channels_last: 'off', 'on' or 'both' layouts for models with 4-D weights.
        batch_size: samples per step (default: the workload's); per rank when ``nproc > 1``.
        steps / warmup: timed and untimed steps per candidate.
        min_time_s: keep timing a candidate until this much timed time has passed (<= 200 steps).
        device: 'cpu', 'cuda[:N]' (default: CUDA when available).
        jsonl: append each finished row to this JSON Lines file at once.
        resume: keep the finished rows already in ``jsonl`` and measure the rest.
        isolate: each candidate in its own process (default: when the workload has a spec):
            isolated CPU peak memory, crash isolation, hard pruning.
        prune_factor: stop a candidate that many times slower than the best step time so far.
        repeat_baseline: measure strict fp32 again at the end, so drift shows.
        progress: receives 'candidate', 'step' and 'row' events.
        candidates: replaces the ``policies`` x ``channels_last`` grid (e.g. a keep_fp32
            rescue); strict fp32 is always measured first.
        nproc: train every candidate data-parallel on that many DDP ranks (needs a spec).
        cudnn_benchmark: let cuDNN autotune its convolutions on CUDA, as NVIDIA's and timm's
            training scripts do (the warm-up steps absorb the tuning).
        deadline: a ``time.perf_counter()`` value; the sweep stops there and returns what it has.
        should_stop: polled between steps; True stops the sweep the same way.
    """
    if not isinstance(workload, Workload):
        raise UsageError(f"bench() takes a mixprec.Workload, got {type(workload).__name__}.")
    _validate(steps, warmup, batch_size, min_time_s, prune_factor)
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise UsageError(f"nproc must be an integer >= 1, got {nproc!r}.")
    if nproc > 1 and workload.spec is None:
        raise UsageError("nproc > 1 needs a workload with a spec (built by load_workload or the zoo).")
    isolate = workload.spec is not None if isolate is None else isolate
    if isolate and workload.spec is None:
        raise UsageError("isolate=True needs a workload with a spec (built by load_workload or the zoo).")
    dev = resolve_device(device)
    info = detect(dev)
    names = parse_policies(policies)
    if "fp32" not in names:
        names.insert(0, "fp32")  # speedups need the strict baseline
    layouts = parse_channels_last(channels_last)
    notes = []
    if True in layouts and not has_4d_weights(workload.model):
        layouts = [False]
        notes.append(
            "channels_last candidates skipped: the model has no 4-D (conv) weights, so it changes nothing"
        )

    def stop_requested() -> bool:
        return (deadline is not None and time.perf_counter() > deadline) or bool(
            should_stop and should_stop()
        )

    progress = progress or (lambda event: None)
    label = workload_label(workload)
    bs = batch_size or workload.default_batch_size
    plan = plan_candidates(names, layouts) if candidates is None else [BASELINE]
    plan += [c for c in (candidates or []) if c not in plan]
    repeats = [BASELINE] if repeat_baseline else []
    settings = BenchSettings(
        device=str(dev),
        batch_size=bs,
        steps=steps,
        warmup=warmup,
        threads=torch.get_num_threads(),
        min_time_s=min_time_s,
        cudnn_benchmark=cudnn_benchmark,
    )
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
            "threads": settings.threads,
            "min_time_s": min_time_s,
            "cudnn_benchmark": cudnn_benchmark and dev.type == "cuda",
        },
        env=environment.collect(dev),
        notes=notes,
        peaks=_peaks(info, plan),
    )
    done: dict[tuple, BenchRow] = {}
    if jsonl is not None:
        if resume:
            # errors and OOMs may be transient: only finished verdicts are kept, the rest re-run
            kept = (Status.OK, Status.UNSUPPORTED, Status.PRUNED)
            done = {r.key: r for r in read_jsonl(jsonl) if r.status in kept}
        else:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            Path(jsonl).write_text("", encoding="utf-8")
    result.flops_per_step = next((r.flops_per_step for r in done.values() if r.flops_per_step), None)
    shared_batches: list | None = None  # in-process runs: one set of batches for all candidates

    schedule = [(c, False) for c in plan] + [(c, True) for c in repeats]
    for index, (cand, is_repeat) in enumerate(schedule):
        if stop_requested():
            result.stopped = (
                f"stopped by the deadline after {len(result.measured)} of {len(schedule)} candidates"
            )
            break
        key = (label, cand, str(dev), bs, is_repeat)
        if key in done:
            result.add(done[key])
            progress(
                {"event": "row", "row": done[key], "index": index, "count": len(schedule), "resumed": True}
            )
            continue
        row = BenchRow(label, cand, str(dev), bs, Status.OK, baseline_repeat=is_repeat)
        progress({"event": "candidate", "label": row.label, "index": index, "count": len(schedule)})
        support = check_support(cand.policy, info)
        if not support:
            hint = f"; try {support.suggestion}" if support.suggestion else ""
            row = BenchRow(
                label,
                cand,
                str(dev),
                bs,
                Status.UNSUPPORTED,
                support.reason + hint,
                baseline_repeat=is_repeat,
            )
        else:
            run_settings = replace(settings, count_flops=result.flops_per_step is None)
            if nproc > 1:
                row = _measure_data_parallel(row, workload, cand, run_settings, nproc)
            else:
                if not isolate and shared_batches is None:
                    try:
                        shared_batches = make_batches(
                            workload, bs, dev, settings.seed, distinct_batches(settings)
                        )
                    except Exception as exc:  # e.g. a batch larger than the device: this row's failure
                        status, reason = _failure(exc)
                        row = BenchRow(label, cand, str(dev), bs, status, reason, baseline_repeat=is_repeat)
                if row.status == Status.OK:
                    ok_rows = [r for r in result.rows if r.status == Status.OK and not r.baseline_repeat]
                    measured = _measure(
                        row,
                        workload,
                        run_settings,
                        isolate,
                        prune_factor,
                        ok_rows,
                        progress,
                        shared_batches,
                        stop_requested,
                    )
                    if measured is None:  # stopped mid-candidate: the sweep ends here
                        result.stopped = (
                            f"stopped by the deadline while measuring {cand.label}, after "
                            f"{len(result.measured)} of {len(schedule)} candidates"
                        )
                        break
                    row = measured
            if row.status == Status.OK and result.flops_per_step is None and row.flops_per_step:
                result.flops_per_step = row.flops_per_step
        result.add(row)
        if jsonl is not None:
            append_jsonl(jsonl, result.rows[-1])
        progress(
            {"event": "row", "row": result.rows[-1], "index": index, "count": len(schedule), "resumed": False}
        )
    return result


def _failure(exc: BaseException) -> tuple[Status, str]:
    """(status, reason) of a candidate that raised: 'oom' for out-of-memory, else 'error'."""
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if isinstance(exc, torch.OutOfMemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the memory back before the next candidate
        return Status.OOM, reason
    return Status.ERROR, reason


def _with_measurement(row: BenchRow, m: Measurement | None, timed_s: list[float], **extra: Any) -> BenchRow:
    """``row`` with the figures of a run: step times (seconds) and what the measurement saw."""
    fields: dict[str, Any] = {"step_times_ms": tuple(t * 1e3 for t in timed_s), **extra}
    if m is not None:
        fields.update(
            first_loss=m.first_loss,
            observed_dtype=m.observed_dtype,
            peak_memory_bytes=m.peak_memory_bytes,
            memory_method=m.memory_method,
            flops_per_step=m.flops_per_step,
        )
    return replace(row, **fields)


def _measure_data_parallel(
    row: BenchRow, workload: Workload, cand: Candidate, settings: BenchSettings, nproc: int
) -> BenchRow:
    """``row`` from a DDP run on ``nproc`` ranks (no pruning: every rank must finish)."""
    from mixprec.measure.data_parallel import rank_medians_ms, run_data_parallel, slowest_rank_step_times

    wall = time.perf_counter()
    outcome = run_data_parallel(workload.spec, cand, settings, nproc)  # type: ignore[arg-type]
    wall_s = time.perf_counter() - wall
    if outcome.status != Status.OK or not outcome.ranks:
        status = Status.OOM if "OutOfMemory" in outcome.reason else Status.ERROR
        return replace(row, status=status, reason=outcome.reason, wall_s=wall_s, world_size=nproc)
    ranks = outcome.ranks
    memories = tuple(m.peak_memory_bytes for m in ranks)
    known = [b for b in memories if b is not None]
    return _with_measurement(
        row,
        ranks[0],
        slowest_rank_step_times(ranks),
        wall_s=wall_s,
        world_size=nproc,
        rank_step_time_ms=tuple(rank_medians_ms(ranks)),
        rank_peak_memory_bytes=memories,
        peak_memory_bytes=max(known) if known else None,
        memory_method=(ranks[0].memory_method + " (the largest rank)") if known else "n/a",
        first_step_ms=ranks[0].warmup_times_s[0] * 1e3 if ranks[0].warmup_times_s else None,
    )


def _measure(
    row: BenchRow,
    workload: Workload,
    settings: BenchSettings,
    isolate: bool,
    prune_factor: float,
    ok_rows: list[BenchRow],
    progress: Progress,
    batches: list | None,
    stop_requested: Callable[[], bool],
) -> BenchRow | None:
    """Run one candidate; its row, or None when the sweep was told to stop during it."""
    cand = row.candidate
    best_median_s = min((r.step_time_ms.median_ms / 1e3 for r in ok_rows if r.step_time_ms), default=None)
    # A cold first step (allocation, kernel selection) is judged against the best candidate's
    # own cold first step, later steps against its median.
    best_first_s = min((r.first_step_ms / 1e3 for r in ok_rows if r.first_step_ms), default=None)
    floor_s = 1.0  # below a second a "hopeless" verdict is process noise, not a measurement
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
    state: dict[str, Any] = {"reason": None, "first_loss": None, "first_step_ms": None, "stopped": False}

    def on_event(event: dict[str, Any]) -> bool:
        if event.get("event") != "step":
            return True
        if stop_requested():
            state["stopped"] = True
            return False
        seen.append(event["seconds"])
        if event["index"] == 0:
            state["first_loss"] = event.get("loss")
            state["first_step_ms"] = event["seconds"] * 1e3
        if event["timed"]:
            timed.append(event["seconds"])
        progress({**event, "label": cand.label})
        limit = step_timeout(event["index"])
        if limit is not None and event["seconds"] > limit:
            state["reason"] = (
                f"step {event['index']} took {event['seconds'] * 1e3:.0f} ms, over {prune_factor:g}x the "
                f"best step time so far ({best_median_s * 1e3:.0f} ms)"  # type: ignore[operator]
            )
            return False
        return True

    measurement: Measurement | None = None
    status, reason = Status.OK, ""
    wall = time.perf_counter()
    if isolate:
        outcome = run_isolated(
            workload.spec,  # type: ignore[arg-type]
            cand,
            settings,
            step_timeout=step_timeout,
            on_event=on_event,
            should_stop=stop_requested,
        )
        if outcome.status == "stopped" or state["stopped"]:
            return None
        status, measurement = Status(outcome.status), outcome.measurement
        reason = state["reason"] or outcome.reason
        if outcome.status == Status.PRUNED and not state["reason"] and best_median_s:
            limit = step_timeout(len(outcome.steps_seen or []))
            factor = (limit or 0) / best_median_s
            reason += f" (best so far {best_median_s * 1e3:.0f} ms/step: at least {factor:.0f}x slower)"
    else:
        try:
            measurement = run_candidate(workload, cand, settings, on_event, batches)
            if state["stopped"]:
                return None
            if measurement.stopped_early:
                status, reason = Status.PRUNED, state["reason"] or "stopped early"
        except Exception as exc:  # any failure of one candidate must not stop the sweep
            status, reason = _failure(exc)
    common = {
        "status": status,
        "reason": reason,
        "wall_s": time.perf_counter() - wall,
        "first_step_ms": state["first_step_ms"],
    }
    if status == Status.PRUNED:
        # Keep the measured figure: the steps that did complete (timed ones if any, else warm-up).
        figures = timed or seen
        if not figures:
            common["reason"] = reason or "pruned before its first step finished"
        return _with_measurement(row, measurement, figures, **common, first_loss=state["first_loss"])
    if status != Status.OK:
        return replace(row, **common)
    out = _with_measurement(row, measurement, measurement.step_times_s if measurement else timed, **common)
    if out.peak_memory_bytes is None:
        out = replace(out, memory_method="n/a: in-process run (isolated CPU memory needs a workload spec)")
    if out.first_loss is not None and not math.isfinite(out.first_loss):
        out = replace(out, status=Status.ERROR, reason=f"non-finite first loss {out.first_loss}")
    return out
