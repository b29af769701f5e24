"""Precision x batch size: each candidate's throughput and peak memory at several micro-batch
sizes, the memory model behind them, and under a memory budget the largest micro-batch each
candidate can run: the speed lower precision buys where its smaller activations let a larger
micro-batch fit, which a table at one batch size cannot show.

The sweep measures peak memory first (:meth:`Framework.peak_memory` at every size, fitted and
checked by :mod:`mixprec.measure.memory`), then times, at each size, the candidates that fit the
budget there, with :func:`mixprec.bench` (paired with strict fp32 at that size, every row as bench
measures it). An out-of-memory at any point is a row (``oom``), never the end of the sweep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from mixprec import validation
from mixprec.budget import Budget
from mixprec.errors import UsageError
from mixprec.events import Events, ignore
from mixprec.frameworks import Framework, framework_of
from mixprec.frameworks.session import MemoryPoint
from mixprec.hardware.device import detect
from mixprec.measure.config import BenchConfig, parse_choice
from mixprec.measure.failure import exception_status
from mixprec.measure.memory import MemoryModel, fit, fit_and_check
from mixprec.measure.results import BenchResult
from mixprec.measure.sweep import plan_candidates, run_sweep
from mixprec.policy import Candidate
from mixprec.status import Status


@dataclass
class BatchRow:
    """One candidate at one micro-batch size.

    Attributes:
        accumulation_steps: micro-batches per optimizer step, so that every size trains the same
            effective batch (1 without one).
        status: bench's status of the timed row, ``oom`` where memory ran out, or ``over-budget``
            where the measured peak is past the budget (not timed).
        samples_per_s: throughput at this micro-batch (None when not timed).
        speedup: ``samples_per_s`` over strict fp32's best throughput at any size that fits.
        peak_bytes: the step's measured peak (see :class:`MemoryPoint`).
        pareto: no other row is at least as fast with at most as much memory.
    """

    candidate: Candidate
    batch_size: int
    status: str
    reason: str = ""
    accumulation_steps: int = 1
    samples_per_s: float | None = None
    step_ms: float | None = None
    peak_bytes: int | None = None
    speedup: float | None = None
    pareto: bool = False

    @property
    def label(self) -> str:
        return self.candidate.label

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate.to_dict(),
            "label": self.label,
            "batch_size": self.batch_size,
            "accumulation_steps": self.accumulation_steps,
            "status": self.status,
            "reason": self.reason,
            "samples_per_s": self.samples_per_s,
            "step_ms": self.step_ms,
            "peak_memory_bytes": self.peak_bytes,
            "speedup_vs_fp32_best": self.speedup,
            "pareto": self.pareto,
        }


@dataclass
class BatchSweep:
    """Throughput and memory per candidate and micro-batch (:func:`bench_batches`).

    Attributes:
        models: the memory model of each candidate (by label), where two sizes were measured.
        max_batch: under ``memory_budget``, the largest micro-batch the model allows per candidate,
            with ``verified`` the measured peak at that size (None where it was not measured).
        results: bench's result at each size, as measured.
    """

    workload: str
    device: str
    batch_sizes: list[int]
    memory_budget: int | None
    effective_batch: int | None = None
    rows: list[BatchRow] = field(default_factory=list)
    models: dict[str, MemoryModel] = field(default_factory=dict)
    max_batch: dict[str, int | None] = field(default_factory=dict)
    verified: dict[str, MemoryPoint | None] = field(default_factory=dict)
    results: dict[int, BenchResult] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "device": self.device,
            "batch_sizes": self.batch_sizes,
            "memory_budget_bytes": self.memory_budget,
            "effective_batch": self.effective_batch,
            "rows": [r.to_dict() for r in self.rows],
            "memory_models": {k: m.to_dict() for k, m in self.models.items()},
            "max_batch": self.max_batch,
            "max_batch_peak": {k: p.to_dict() if p else None for k, p in self.verified.items()},
            "notes": self.notes,
            "bench": {str(b): r.to_dict() for b, r in self.results.items()},
        }


def parse_batch_sizes(text: str | Sequence[int]) -> list[int]:
    """``'8,16,32'`` (or a list) as sorted distinct positive sizes."""
    items = text.split(",") if isinstance(text, str) else list(text)
    sizes = []
    for item in items:
        try:
            size = int(str(item).strip())
        except ValueError:
            size = 0
        if size < 1:
            raise UsageError(
                f"batch size {str(item).strip()!r} in {text!r} is not a positive integer; write the sizes "
                "like 8,16,32."
            )
        sizes.append(size)
    if not sizes:
        raise UsageError("no batch sizes given; write them like 8,16,32.")
    return sorted(set(sizes))


def _accumulation(sizes: list[int], effective_batch: int | None) -> dict[int, int]:
    """Micro-batches per optimizer step at each size: ``effective_batch // size`` (1 without one)."""
    if effective_batch is None:
        return dict.fromkeys(sizes, 1)
    validation.positive_int("effective_batch", effective_batch)
    bad = [s for s in sizes if effective_batch % s]
    if bad:
        divisors = [d for d in range(1, effective_batch + 1) if effective_batch % d == 0]
        raise UsageError(
            f"batch size {bad[0]} does not divide the effective batch {effective_batch}: every micro-batch "
            f"size must, so each step trains the same samples; valid sizes: {', '.join(map(str, divisors))}."
        )
    return {s: effective_batch // s for s in sizes}


def _failure(exc: BaseException) -> tuple[str, str]:
    """A failure's row status (``oom`` or ``error``) and one-line reason (an empty message too)."""
    lines = str(exc).splitlines()
    return exception_status(exc), f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def measure_peak(
    framework: Framework,
    workload: Any,
    candidate: Candidate,
    device: str,
    batch_size: int,
    accumulation_steps: int = 1,
) -> MemoryPoint | tuple[str, str]:
    try:
        return framework.peak_memory(workload, candidate, device, batch_size, accumulation_steps)
    except Exception as exc:  # one candidate's failure is a row, not the end of the sweep
        return _failure(exc)


VERIFY_TRIES = 6  # measured steps to find and confirm the largest micro-batch that fits


def largest_that_fits(
    measure: Callable[[int], MemoryPoint | tuple[str, str]],
    model: MemoryModel,
    memory_budget: int,
    measured: dict[int, MemoryPoint],
) -> tuple[int | None, MemoryPoint | None]:
    """The largest micro-batch within the budget, confirmed by a measured step there. The model
    predicts it; every size measured (``measure(size)``: a point, or a failure's status and reason)
    joins ``measured`` and the fit (the line through the two largest sizes measured: far out,
    activations set the slope, which small sizes can understate) and the line predicts again, a
    secant search, until it predicts no larger size than one that fitted. An out-of-memory counts as
    past the budget. What returns is a measured size: the largest that fitted, never only a
    prediction."""
    measured = dict(measured)
    best: tuple[int, MemoryPoint] | None = max(
        ((s, p) for s, p in measured.items() if p.peak_bytes <= memory_budget), default=None
    )
    most = model.max_batch(memory_budget)
    for _ in range(VERIFY_TRIES):
        if most is None or most in measured or (best is not None and most <= best[0]):
            break
        got = measure(most)
        if not isinstance(got, MemoryPoint):  # out of memory there: past the budget, by far
            got = MemoryPoint(most, memory_budget * 2)
        measured[most] = got
        if got.peak_bytes <= memory_budget:
            best = (most, got)
        (_, low), (_, high) = sorted(measured.items())[-2:]
        ahead = fit(model.label, [low, high]).max_batch(memory_budget)
        most = ahead if got.peak_bytes <= memory_budget else min(ahead or 0, most - 1) or None
    return (best[0], best[1]) if best else (None, None)


def bench_batches(
    workload: Any,
    batch_sizes: str | Sequence[int],
    *,
    memory_budget: int | None = None,
    effective_batch: int | None = None,
    config: BenchConfig | None = None,
    events: Events | None = None,
    budget: Budget | None = None,
    **fields: Any,
) -> BatchSweep:
    """Throughput and peak memory of each candidate at each of ``batch_sizes``; under
    ``memory_budget`` (bytes) the largest micro-batch each can run, verified by one measured step.
    With ``effective_batch``, every size trains that many samples per optimizer step (gradient
    accumulation over ``effective_batch // size`` micro-batches; each size must divide it), so the
    throughputs compare like with like. ``config`` (a :class:`BenchConfig`, NCHW only by default)
    and its ``fields`` say what is timed at every size and how (policies, layouts, steps, warmup,
    isolate, ...); its batch size and accumulation are each size's."""
    config = validation.with_fields(config or BenchConfig(channels_last="off"), fields, "bench_batches")
    framework = framework_of(workload)
    sizes = parse_batch_sizes(batch_sizes)
    if memory_budget is not None:
        memory_budget = validation.byte_size("memory_budget", memory_budget)
    accumulation = _accumulation(sizes, effective_batch)
    dev = framework.resolve_device(config.device)
    events = events or ignore
    budget = budget or Budget.unlimited()
    info = detect(dev)
    layouts, _ = framework.bench_layouts(workload, parse_choice(config.channels_last, "channels_last"))
    plan = plan_candidates(framework, config.policy_names, layouts, parse_choice(config.compile, "compile"))
    plan = [c for c in plan if framework.support(c, info, workload).supported]
    events({"event": "stage", "text": "checking the workload: one strict-fp32 step"})
    framework.validate_workload(workload, dev, sizes[0], budget=budget)
    sweep = BatchSweep(framework.workload_label(workload), dev, sizes, memory_budget, effective_batch)

    peaks: dict[tuple[Candidate, int], MemoryPoint] = {}
    failed: dict[tuple[Candidate, int], tuple[str, str]] = {}
    for cand in plan:
        for size in sizes:
            if budget.expired():
                break
            events({"event": "stage", "text": f"peak memory of {cand.label} at batch {size}"})
            got = measure_peak(framework, workload, cand, dev, size)
            if isinstance(got, MemoryPoint):
                peaks[cand, size] = got
            else:
                failed[cand, size] = got
        points = [peaks[cand, s] for s in sizes if (cand, s) in peaks]
        if len({p.batch_size for p in points}) >= 2:
            model = sweep.models[cand.label] = fit_and_check(cand.label, points)
            if memory_budget is not None:
                measured = {s: p for (c, s), p in peaks.items() if c == cand}
                most, verified = largest_that_fits(
                    partial(measure_peak, framework, workload, cand, dev), model, memory_budget, measured
                )
                sweep.max_batch[cand.label], sweep.verified[cand.label] = most, verified
    if len(sizes) < 2:
        sweep.notes.append("one batch size: no memory model (give two sizes or more to fit one)")

    for size in sizes:
        if budget.expired():
            sweep.notes.append(f"the time budget ran out before batch {size} was timed")
            break
        fits = [
            c
            for c in plan
            if (c, size) not in failed
            and (memory_budget is None or ((c, size) in peaks and peaks[c, size].peak_bytes <= memory_budget))
        ]
        for cand in plan:
            if (cand, size) in failed:
                status, reason = failed[cand, size]
                sweep.rows.append(BatchRow(cand, size, status, reason, accumulation[size]))
            elif cand not in fits:
                peak = peaks[cand, size].peak_bytes if (cand, size) in peaks else None
                sweep.rows.append(
                    BatchRow(cand, size, Status.OVER_BUDGET, "", accumulation[size], peak_bytes=peak)
                )
        if not fits:
            continue
        events({"event": "stage", "text": f"timing {len(fits)} candidates at batch {size}"})
        at_size = replace(
            config, candidates=tuple(fits), batch_size=size, accumulation_steps=accumulation[size], device=dev
        )
        try:
            result = run_sweep(workload, framework, at_size, device=dev, events=events, budget=budget)
        except Exception as exc:  # e.g. out of memory making the batches: this size's rows say so
            status, reason = _failure(exc)
            sweep.rows += [BatchRow(c, size, status, reason, accumulation[size]) for c in fits]
            continue
        sweep.results[size] = result
        timed = {row.candidate: row for row in result.rows if not row.baseline_repeat}
        for cand in fits:
            row = timed.get(cand)
            if row is None:
                sweep.rows.append(
                    BatchRow(cand, size, Status.ERROR, "not measured by bench", accumulation[size])
                )
                continue
            st = row.step_time_ms
            sweep.rows.append(
                BatchRow(
                    cand,
                    size,
                    str(row.status),
                    row.reason,
                    accumulation[size],
                    row.throughput,
                    st.median_ms if st is not None else None,
                    peaks[cand, size].peak_bytes if (cand, size) in peaks else row.peak_memory_bytes,
                )
            )
    _rank(sweep, framework.baseline)
    return sweep


def _rank(sweep: BatchSweep, baseline: Candidate) -> None:
    """Speedup against strict fp32's best throughput at any size that fits, and the Pareto front
    of throughput against peak memory."""
    fp32 = [r.samples_per_s for r in sweep.rows if r.candidate == baseline and r.samples_per_s]
    best = max(fp32, default=None)
    timed = [r for r in sweep.rows if r.samples_per_s]
    for row in timed:
        row.speedup = row.samples_per_s / best if best and row.samples_per_s else None
        row.pareto = row.peak_bytes is not None and not any(
            o is not row
            and o.peak_bytes is not None
            and o.samples_per_s is not None
            and row.samples_per_s is not None
            and o.samples_per_s >= row.samples_per_s
            and o.peak_bytes <= row.peak_bytes
            and (o.samples_per_s > row.samples_per_s or o.peak_bytes < row.peak_bytes)
            for o in timed
        )
    sweep.rows.sort(key=lambda r: (r.label, r.batch_size))
