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
from mixprec.hardware.peaks import cpu_peak, peak_flops
from mixprec.measure import noise
from mixprec.measure.effect import math_mode_effect
from mixprec.measure.failure import exception_status, failure_status
from mixprec.measure.isolate import SessionEnded
from mixprec.measure.paired import BASELINE, PairedSweep
from mixprec.measure.results import BenchResult, BenchRow, Peaks
from mixprec.measure.rowstore import RowStore
from mixprec.measure.runner import BenchSettings, Measurement, distinct_batches, make_batches
from mixprec.policy import POLICY_NAMES, Candidate, canonical_name, check_support
from mixprec.status import Status
from mixprec.workload import Workload, validate_workload

Progress = Callable[[dict[str, Any]], None]
CHANNELS_LAST_CHOICES = ("off", "on", "both")


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
    resume_anyway: bool = False,
    isolate: bool | None = None,
    prune_factor: float = 5.0,
    progress: Progress | None = None,
    candidates: Sequence[Candidate] | None = None,
    nproc: int = 1,
    cudnn_benchmark: bool = True,
    deadline: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> BenchResult:
    """Measure every candidate policy on ``workload``'s real training step, paired with strict fp32.

    Args:
        workload: the model, its batches, loss and optimizer.
        policies: 'all', or policy names (a list or a comma-separated string).
        channels_last: 'off', 'on' or 'both' layouts for models with 4-D weights.
        batch_size: samples per step (default: the workload's); per rank when ``nproc > 1``.
        steps: timed steps (paired rounds) per candidate, at least.
        warmup: untimed steps per candidate, at least (more until the step time is steady).
        min_time_s: keep timing a candidate until this much timed time has passed (<= 200 steps).
        device: 'cpu', 'cuda[:N]' (default: CUDA when available).
        jsonl: append each finished row to this JSON Lines file at once.
        resume: keep the finished rows already in ``jsonl`` and measure the rest. Rows measured
            under other settings (see :func:`resume_key`) are refused with a UsageError naming them.
        resume_anyway: with ``resume``, keep rows measured under other settings too.
        isolate: each candidate in its own process (default: when the workload has a spec):
            isolated CPU peak memory, crash isolation, hard pruning.
        prune_factor: stop a candidate that many times slower than the best so far (compared
            like with like, retried once at the end; see :mod:`mixprec.measure.paired`).
        progress: receives 'candidate', 'step' and 'row' events, and 'output' (what rebuilding
            the workload printed in a candidate's process, already shown once by this one).
        candidates: replaces the ``policies`` x ``channels_last`` grid (e.g. a keep_fp32
            rescue); strict fp32 is always measured too, as the baseline.
        nproc: train every candidate data-parallel on that many DDP ranks (needs a spec); these
            runs are sequential, not paired.
        cudnn_benchmark: let cuDNN autotune its convolutions on CUDA, as NVIDIA's and timm's
            training scripts do (the warm-up steps absorb the tuning).
        deadline: a ``time.perf_counter()`` value; the sweep stops there and returns what it has.
        should_stop: polled between steps; True stops the sweep the same way.

    Before measuring, one strict-fp32 step in this process validates the workload
    (:func:`mixprec.workload.validate_workload`): a broken ``make_batch``, ``loss_fn`` or
    ``optimizer_fn`` raises one :class:`UsageError` instead of failing every row alike.
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
    # One strict-fp32 step here first: a broken make_batch / loss_fn / optimizer_fn is one clear
    # error now, not the same failure in every row.
    validate_workload(workload, device=dev, batch_size=bs)
    plan = plan_candidates(names, layouts) if candidates is None else [BASELINE]
    plan += [c for c in (candidates or []) if c not in plan]
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
            "paired": nproc == 1,
        },
        env=environment.collect(dev),
        notes=notes,
        peaks=_peaks(info, plan),
    )
    key = resume_key(label, settings, prune_factor=prune_factor, isolate=isolate, nproc=nproc)
    rows = RowRecorder(result, progress, len(plan), jsonl, key, resume=resume, resume_anyway=resume_anyway)
    done, record = rows.done, rows.record
    result.flops_per_step = next((r.flops_per_step for r in done.values() if r.flops_per_step), None)
    try:
        _run_sweep(
            workload,
            plan,
            settings,
            isolate,
            prune_factor,
            nproc,
            info,
            result,
            done,
            record,
            stop_requested,
            progress,
        )
    finally:
        rows.close()
    return result


class RowRecorder:
    """Where a sweep's finished rows go: into the result (derived figures recomputed), onto the
    row stream when there is one, and to ``progress``. ``done`` holds the finished rows a resumed
    stream already had; errors and OOMs may be transient, so those rows are measured again."""

    KEPT = (Status.OK, Status.UNSUPPORTED, Status.PRUNED, Status.NO_EFFECT)

    def __init__(
        self,
        result: BenchResult,
        progress: Progress,
        count: int,
        jsonl: str | Path | None,
        key: dict[str, Any],
        *,
        resume: bool,
        resume_anyway: bool = False,
    ) -> None:
        self.result, self.progress, self.count = result, progress, count
        self.store: RowStore | None = None
        self.done: dict[tuple, BenchRow] = {}
        if jsonl is not None:
            self.store = RowStore(jsonl, key, resume=resume, resume_anyway=resume_anyway)
            for note in self.store.notes:
                result.notes.append(note)
                progress({"event": "note", "text": note})
            self.done = {r.key: r for r in self.store.rows if r.status in self.KEPT}

    def record(self, row: BenchRow, index: int, resumed: bool = False) -> None:
        self.result.update(row)
        shown = next(r for r in self.result.rows if r.key == row.key)
        if self.store is not None and not resumed:
            self.store.append(shown)
        self.progress({"event": "row", "row": shown, "index": index, "count": self.count, "resumed": resumed})

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def resume_key(
    label: str, settings: BenchSettings, *, prune_factor: float, isolate: bool, nproc: int
) -> dict[str, Any]:
    """Every setting that changes a figure of a row: rows measured under another key are not
    comparable with this run's (a resumed sweep refuses them)."""
    from mixprec import __version__

    return {
        "workload": label,
        "device": settings.device,
        "batch_size": settings.batch_size,
        "steps": settings.steps,
        "warmup": settings.warmup,
        "min_time_s": settings.min_time_s,
        "threads": settings.threads,
        "cudnn_benchmark": settings.cudnn_benchmark and settings.device.startswith("cuda"),
        "prune_factor": prune_factor,
        "isolate": isolate,
        "nproc": nproc,
        "torch": torch.__version__,
        "mixprec": __version__,
    }


def _run_sweep(
    workload: Workload,
    plan: list[Candidate],
    settings: BenchSettings,
    isolate: bool,
    prune_factor: float,
    nproc: int,
    info: DeviceInfo,
    result: BenchResult,
    done: dict[tuple, BenchRow],
    record: Callable[..., None],
    stop_requested: Callable[[], bool],
    progress: Progress,
) -> None:
    dev = settings.device
    start = noise.snapshot(dev)
    if nproc > 1:
        _sweep_data_parallel(
            workload, plan, settings, nproc, info, result, done, record, stop_requested, progress
        )
    else:
        _sweep_paired(
            workload,
            plan,
            settings,
            isolate,
            prune_factor,
            info,
            result,
            done,
            record,
            stop_requested,
            progress,
        )
    order = {cand: i for i, cand in enumerate(plan)}
    result.measured.sort(key=lambda r: order.get(r.candidate, len(plan)))  # resumed rows too, in plan order
    base = result.baseline
    result.noise = noise.summarize(start, noise.snapshot(dev), base.step_times_ms if base else ())
    _revalidate_cpu_peaks(result, info)


def _sweep_paired(
    workload: Workload,
    plan: list[Candidate],
    settings: BenchSettings,
    isolate: bool,
    prune_factor: float,
    info: DeviceInfo,
    result: BenchResult,
    done: dict[tuple, BenchRow],
    record: Callable[..., None],
    stop_requested: Callable[[], bool],
    progress: Progress,
) -> None:
    label, device, bs = result.workload, settings.device, settings.batch_size
    todo = [(i, c) for i, c in enumerate(plan) if (label, c, device, bs, False) not in done or c == BASELINE]
    for i, cand in enumerate(plan):
        key = (label, cand, device, bs, False)
        if key in done and cand != BASELINE:
            record(done[key], i, resumed=True)
    if not todo:
        return
    batches = None
    if not isolate:
        try:
            batches = make_batches(
                workload, bs, torch.device(device), settings.seed, distinct_batches(settings)
            )
        except Exception as exc:  # e.g. a batch larger than the device: every row fails alike
            status, reason = _failure(exc)
            for i, cand in todo:
                record(BenchRow(label, cand, device, bs, status, reason), i)
            return
    sweep = PairedSweep(
        workload,
        settings,
        label=label,
        isolate=isolate,
        prune_factor=prune_factor,
        progress=progress,
        should_stop=stop_requested,
        batches=batches,
    )
    run_paired(
        sweep,
        plan,
        todo,
        result,
        record,
        stop_requested,
        progress,
        refuse=lambda cand: _refused(cand, label, settings, info, workload, batches),
    )


def run_paired(
    sweep: PairedSweep,
    plan: list[Candidate],
    todo: list[tuple[int, Candidate]],
    result: BenchResult,
    record: Callable[..., None],
    stop_requested: Callable[[], bool],
    progress: Progress,
    refuse: Callable[[Candidate], BenchRow | None],
) -> None:
    """The baseline, then each candidate of ``todo`` (index in ``plan``, candidate) paired with it
    (or the row ``refuse`` gives instead of measuring it), the pruned ones retried once, and the
    baseline's final row. Every framework's sweep runs this loop; ``sweep`` opens its sessions."""
    baseline_cand = sweep.baseline_candidate
    label, device, bs = result.workload, sweep.settings.device, sweep.settings.batch_size
    progress({"event": "candidate", "label": baseline_cand.label, "index": 0, "count": len(plan)})
    try:
        try:
            record(sweep.start_baseline(count_flops=result.flops_per_step is None), 0)
        except SessionEnded as ended:
            if ended.status == "stopped":
                result.stopped = "stopped by the deadline before strict fp32 was measured"
                return
            row = BenchRow(
                label,
                baseline_cand,
                device,
                bs,
                Status(ended.status),
                f"strict fp32 failed: {ended.reason}",
                error_traceback=ended.traceback,
            )
            for i, cand in todo:
                record(replace(row, candidate=cand), i)
            return
        pruned: list[tuple[int, BenchRow]] = []
        for i, cand in todo:
            if cand == baseline_cand:
                continue
            if stop_requested():
                result.stopped = f"stopped by the deadline before {cand.label}"
                break
            progress({"event": "candidate", "label": cand.label, "index": i, "count": len(plan)})
            refused = refuse(cand)
            if refused is not None:
                row = refused
            else:
                try:
                    row = sweep.measure(cand)
                except SessionEnded:  # told to stop while measuring it
                    result.stopped = f"stopped by the deadline while measuring {cand.label}"
                    break
            if row.status == Status.PRUNED:
                pruned.append((i, row))
            record(row, i)
        # A transient must not prune a candidate for good: one more attempt, when time is left.
        for i, first in pruned:
            if result.stopped or stop_requested():
                break
            progress(
                {
                    "event": "candidate",
                    "label": f"{first.candidate.label} (retry)",
                    "index": i,
                    "count": len(plan),
                }
            )
            try:
                again = sweep.measure(first.candidate)
            except SessionEnded:
                result.stopped = f"stopped by the deadline while retrying {first.candidate.label}"
                break
            if again.status == Status.PRUNED:
                again = replace(again, reason=f"pruned twice: {first.reason}; again: {again.reason}")
            else:
                again = replace(
                    again,
                    notes=(
                        *again.notes,
                        f"pruned on the first attempt ({first.reason}); measured on a retry",
                    ),
                )
            record(again, i)
        baseline = sweep.finish_baseline()
        result.flops_per_step = result.flops_per_step or baseline.flops_per_step
        record(baseline, 0)
    finally:
        sweep.close()


def _refused(
    cand: Candidate,
    label: str,
    settings: BenchSettings,
    info: DeviceInfo,
    workload: Workload,
    batches: list | None,
) -> BenchRow | None:
    """The row of a candidate that is not measured: unsupported here, or a math mode that computes
    what strict fp32 computes on this workload; None when it should be measured."""
    device, bs = settings.device, settings.batch_size
    support = check_support(cand.policy, info)
    if not support:
        hint = f"; try {support.suggestion}" if support.suggestion else ""
        return BenchRow(label, cand, device, bs, Status.UNSUPPORTED, support.reason + hint)
    if cand.spec.is_math_mode and cand.policy != "fp32":
        try:
            batch = (batches or make_batches(workload, bs, torch.device(device), settings.seed, 1))[0]
            effect = math_mode_effect(workload, cand, batch, torch.device(device))
        except Exception:  # the probe is an optimisation: when it cannot run, measure instead
            return None
        if effect.no_effect:
            return BenchRow(label, cand, device, bs, Status.NO_EFFECT, effect.describe(cand))
    return None


def _sweep_data_parallel(
    workload: Workload,
    plan: list[Candidate],
    settings: BenchSettings,
    nproc: int,
    info: DeviceInfo,
    result: BenchResult,
    done: dict[tuple, BenchRow],
    record: Callable[..., None],
    stop_requested: Callable[[], bool],
    progress: Progress,
) -> None:
    label, device, bs = result.workload, settings.device, settings.batch_size
    for i, cand in enumerate(plan):
        key = (label, cand, device, bs, False)
        if key in done:
            record(done[key], i, resumed=True)
            continue
        if stop_requested():
            result.stopped = f"stopped by the deadline before {cand.label}"
            break
        progress({"event": "candidate", "label": cand.label, "index": i, "count": len(plan)})
        support = check_support(cand.policy, info)
        if not support:
            hint = f"; try {support.suggestion}" if support.suggestion else ""
            record(BenchRow(label, cand, device, bs, Status.UNSUPPORTED, support.reason + hint), i)
            continue
        run_settings = replace(settings, count_flops=result.flops_per_step is None)
        row = _measure_data_parallel(
            BenchRow(label, cand, device, bs, Status.OK), workload, cand, run_settings, nproc
        )
        if result.flops_per_step is None and row.flops_per_step:
            result.flops_per_step = row.flops_per_step
        record(row, i)


def _revalidate_cpu_peaks(result: BenchResult, info: DeviceInfo) -> None:
    """A run faster than the measured CPU peak proves the peak low: measure it again (keeping the
    larger), once per sweep; what still exceeds it is shown as MFU n/a by :func:`assemble`."""
    if info.type != "cpu":
        return
    beaten = {
        r.candidate.spec.peak_key
        for r in result.rows
        if r.achieved_tflops and r.peak_flops and r.achieved_tflops * 1e12 > r.peak_flops
    }
    for key in beaten:
        try:
            result.peaks[key] = cpu_peak(key, info, refresh=True)
        except (RuntimeError, OSError, UsageError):
            continue


def _failure(exc: BaseException) -> tuple[Status, str]:
    """(status, reason) of a candidate that raised: 'oom' for out-of-memory, else 'error'."""
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    status = exception_status(exc)
    if status == Status.OOM and torch.cuda.is_available():
        torch.cuda.empty_cache()  # give the memory back before the next candidate
    return status, reason


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
        status = failure_status(outcome.reason, outcome.reason)  # "OutOfMemoryError: ..."
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
