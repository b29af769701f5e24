"""Bench results: immutable rows, the sweep's result, and their JSON / CSV forms (the JSON Lines
row stream is :mod:`mixprec.measure.rowstore`).

A :class:`BenchRow` holds what one candidate's run measured (raw step times, memory, loss).
The figures that follow from them and from the rest of the sweep (speedup against the strict
fp32 baseline, achieved FLOP/s, MFU) are computed in one place, :func:`assemble`, each time
:attr:`BenchResult.rows` is read: a row can never show a figure from an older baseline.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from mixprec.files import atomic_write_text
from mixprec.measure.mfu import achieved_tflops, mfu
from mixprec.measure.repeats import widen
from mixprec.policy import Candidate
from mixprec.schema import SCHEMA_VERSION, check_version, known_fields
from mixprec.status import Status

# How a pruned row that never ran begins its reason (:attr:`BenchRow.spared`).
SPARED = "not measured: "

STATUSES = (Status.OK, Status.UNSUPPORTED, Status.OOM, Status.ERROR, Status.PRUNED, Status.NO_EFFECT)


# BenchRow's tuple fields: lists in its JSON
_SEQUENCES = (
    "step_times_ms",
    "rank_step_time_ms",
    "rank_peak_memory_bytes",
    "paired_ratios",
    "sessions",
    "notes",
)


@dataclass(frozen=True)
class StepTime:
    """Median, inter-quartile range and count of timed step times, in milliseconds."""

    median_ms: float
    iqr_ms: float
    n: int

    @classmethod
    def of(cls, step_ms: Iterable[float]) -> StepTime | None:
        times = list(step_ms)
        if not times:
            return None
        q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
        return cls(statistics.median(times), q[2] - q[0], len(times))

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median_ms, "iqr": self.iqr_ms, "n": self.n}


@dataclass(frozen=True)
class BenchRow:
    """One measured (or refused) candidate.

    Attributes:
        workload: the workload's label, e.g. 'resnet50(image_size=128)'.
        candidate: what ran.
        device: where it ran ('cpu', 'cuda:0').
        batch_size: samples per micro-batch (per rank in data-parallel runs).
        accumulation_steps: micro-batches per optimizer step (gradient accumulation): a step is
            ``batch_size * accumulation_steps`` samples.
        status: ok, unsupported, oom, error or pruned.
        reason: why a row is not ok (or how a pruned row was judged).
        step_times_ms: the timed steps; a pruned row keeps the steps it completed.
        first_step_ms: the cold first (warm-up) step.
        first_loss: the loss of the first step.
        observed_dtype: the output dtype of the first matmul/conv, as it really ran.
        peak_memory_bytes / memory_method: peak memory and how it was measured.
        flops_per_step: FLOPs of one training step (torch.utils.flop_counter), per rank.
        wall_s: wall time the candidate took, setup included.
        baseline_repeat: the strict-fp32 re-measurement at the end of a sweep (drift check).
        world_size: data-parallel ranks; throughput counts every rank's batch.
        rank_step_time_ms / rank_peak_memory_bytes: per rank, in data-parallel runs.
        paired_ratios: per round, the strict-fp32 step time over this candidate's step time,
            measured back to back (see :mod:`mixprec.measure.paired`).
        sessions: how many of ``paired_ratios`` each session measured, in order, where a settled
            row pooled more than one (:mod:`mixprec.measure.settle`); empty: one session. How much
            each session weighs in the row's figure: :func:`session_speedup`.
        earlier: the paired rounds of the sessions of this configuration this machine measured
            before (its record, :mod:`mixprec.measure.record`), one tuple per session, which a
            settled figure pools with its own (empty: none pooled).
        graph_breaks / graphs / recompiles: torch.compile candidates: graph breaks, graphs
            compiled, and graphs compiled after the first step.
        compute_share: share of one profiled step's operator time spent in matmuls, convolutions
            and attention (low: the next gain is in fusion or the input pipeline, not precision).
        optimizer_share: share of it inside the optimizer's step (eager steps): what compiling the
            whole step can fuse beyond the model's graphs.
        notes: what happened to this row beyond its status (e.g. measured on a retry).
        error_traceback: an error row's traceback (its innermost frames), from the candidate's
            own process where it ran in one; kept in JSON, shown by ``--debug``.
        speedup_vs_fp32, speedup_ci, repeat_ci, achieved_tflops, mfu, mfu_note, peak_flops,
            peak_flops_source: derived by :func:`assemble` from the sweep; never set them by hand.
            ``speedup_ci`` is the bootstrap interval of the paired ratios' median (the noise within
            this run: what candidates measured together are compared by); ``repeat_ci`` is where a
            repeat run of it on this machine lands, 19 times in 20 (:mod:`mixprec.measure.repeats`),
            what the reports show as the speedup's interval (:attr:`interval`).
    """

    workload: str
    candidate: Candidate
    device: str
    batch_size: int
    status: str
    reason: str = ""
    step_times_ms: tuple[float, ...] = ()
    first_step_ms: float | None = None
    first_loss: float | None = None
    observed_dtype: str | None = None
    peak_memory_bytes: int | None = None
    memory_method: str = ""
    flops_per_step: int | None = None
    wall_s: float | None = None
    baseline_repeat: bool = False
    world_size: int = 1
    accumulation_steps: int = 1
    rank_step_time_ms: tuple[float, ...] = ()
    rank_peak_memory_bytes: tuple[int | None, ...] = ()
    paired_ratios: tuple[float, ...] = ()
    sessions: tuple[int, ...] = ()
    earlier: tuple[tuple[float, ...], ...] = ()
    graph_breaks: int | None = None
    graphs: int | None = None
    recompiles: int | None = None
    compute_share: float | None = None
    optimizer_share: float | None = None
    notes: tuple[str, ...] = ()
    error_traceback: str = ""
    # derived (assemble)
    speedup_vs_fp32: float | None = None
    speedup_ci: tuple[float, float] | None = None
    repeat_ci: tuple[float, float] | None = None
    achieved_tflops: float | None = None
    mfu: float | None = None
    mfu_note: str = ""
    peak_flops: float | None = None
    peak_flops_source: str = ""

    @property
    def policy(self) -> str:
        return self.candidate.policy

    @property
    def channels_last(self) -> bool:
        return self.candidate.channels_last

    @property
    def keep_fp32(self) -> tuple[str, ...]:
        return self.candidate.keep_fp32

    @property
    def label(self) -> str:
        return self.candidate.label + (" (repeat)" if self.baseline_repeat else "")

    @property
    def spared(self) -> bool:
        """A pruned row that never ran: another candidate in its format, which the device only
        emulates, was pruned or measured far slower than strict fp32 (its reason says which)."""
        return self.status == Status.PRUNED and self.reason.startswith(SPARED)

    @property
    def interval(self) -> tuple[float, float] | None:
        """The speedup's interval as reported: where a repeat run lands (``repeat_ci``) where the
        result knows the spread between runs, else the run's own (``speedup_ci``)."""
        return self.repeat_ci or self.speedup_ci

    @cached_property
    def step_time_ms(self) -> StepTime | None:
        return StepTime.of(self.step_times_ms)

    @property
    def throughput(self) -> float | None:
        """Samples per second over all ranks, from the median step time."""
        st = self.step_time_ms
        if st is None or st.median_ms <= 0:
            return None
        return self.world_size * self.batch_size * self.accumulation_steps / (st.median_ms / 1e3)

    @property
    def compile_s(self) -> float | None:
        """Seconds the first (cold) step took beyond a steady one: compilation for compiled candidates."""
        st = self.step_time_ms
        if self.first_step_ms is None or st is None:
            return None
        return max(0.0, (self.first_step_ms - st.median_ms) / 1e3)

    @property
    def key(self) -> tuple:
        """Identity for --resume: the same candidate on the same workload, device and batch size."""
        return (self.workload, self.candidate, self.device, self.batch_size, self.baseline_repeat)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        cand = self.candidate.to_dict()
        del d["candidate"]
        d = {
            "workload": d.pop("workload"),
            "label": self.label,
            **cand,
            **d,
            "throughput": self.throughput,
            "step_time_ms": self.step_time_ms.to_dict() if self.step_time_ms else None,
        }
        for key in _SEQUENCES:
            d[key] = list(d[key])
        d["earlier"] = [list(session) for session in self.earlier]
        d["speedup_ci"] = list(self.speedup_ci) if self.speedup_ci else None
        d["repeat_ci"] = list(self.repeat_ci) if self.repeat_ci else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchRow:
        data = known_fields(cls, d)
        flat = d.get("candidate", d)
        if flat is d and d.get("micro_batch") is None:
            # the row's own accumulation_steps (bench --effective-batch) shares the flat dict with the
            # candidate's: a candidate without a micro-batch of its own accumulates nothing itself
            flat = {**d, "accumulation_steps": 1}
        data["candidate"] = Candidate.from_dict(flat)
        for key in _SEQUENCES:
            data[key] = tuple(d.get(key) or ())
        data["earlier"] = tuple(tuple(float(v) for v in session) for session in d.get("earlier") or ())
        for key in ("speedup_ci", "repeat_ci"):
            ci = d.get(key)
            data[key] = (float(ci[0]), float(ci[1])) if ci else None
        return cls(**data)


def spared_said(rows: Sequence[BenchRow]) -> str:
    """What a recommendation says of ``rows``, each :attr:`BenchRow.spared`."""
    several = len({r.candidate.spec.low_precision_dtype for r in rows}) > 1
    which = "their formats, and a candidate in each" if several else "their format, and a candidate in it"
    return (
        f"{', '.join(r.label for r in rows)} not measured: this device only emulates {which} was pruned or "
        "measured far slower than strict fp32"
    )


def baseline_row(rows: Iterable[BenchRow]) -> BenchRow | None:
    """The strict-fp32 NCHW row measured first: what every speedup refers to."""
    return next(
        (
            r
            for r in rows
            if r.policy == "fp32"
            and not r.channels_last
            and not r.baseline_repeat
            and r.status == Status.OK
            and r.throughput
        ),
        None,
    )


Peaks = dict[str, tuple[float | None, str]]  # a spec's peak_key -> (FLOP/s or None, source)


def sessions_fit(rounds: int, sessions: Sequence[int]) -> bool:
    """Whether ``sessions`` (rounds per session; empty: one) split ``rounds`` paired ratios."""
    whole = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sessions)
    return rounds >= 1 and whole and (not sessions or sum(sessions) == rounds)


def _sessions_of(values: Sequence[float], sessions: Sequence[int]) -> list[list[float]]:
    """``values`` split into their sessions (``sessions``: rounds per session, in order; empty: one)."""
    if not sessions_fit(len(values), sessions):
        raise ValueError(f"{len(values)} paired ratios do not split into sessions of {list(sessions)} rounds")
    sizes = list(sessions) or [len(values)]
    starts = itertools.accumulate([0, *sizes])
    return [list(values[a:b]) for a, b in itertools.pairwise(starts)]


def own_sessions(row: BenchRow) -> list[list[float]]:
    """``row``'s paired ratios, split into the sessions that measured them."""
    return _sessions_of(row.paired_ratios, row.sessions) if row.paired_ratios else []


def session_speedup(
    values: Sequence[float],
    sessions: Sequence[int] = (),
    *,
    level: float = 0.95,
    earlier: Sequence[Sequence[float]] = (),
) -> tuple[float, tuple[float, float] | None]:
    """The figure of paired ratios measured over ``sessions`` (rounds per session, in order; empty:
    one session) and its interval, pooled with the sessions of ``earlier`` (each its rounds: the
    machine's record of the configuration, :mod:`mixprec.measure.record`) as with its own. One
    session: the median of its rounds, with :func:`median_ci`. More: each session's median, weighed
    as a random-effects meta-analysis weighs studies (DerSimonian-Laird, in log space): by its
    precision (rounds over the spread of rounds within sessions) plus the spread between sessions
    beyond what that precision explains.
    Sessions that agree weigh by their rounds, as one long session would; sessions that disagree
    weigh nearer the same, and the interval holds the disagreement. Why: on the 2-core AMX Xeon one
    process pair's 18 rounds sat ~25% below the sessions before and after it; pooled round by round,
    that longest session was tune's figure (issue 53). Three or more sessions that disagree beyond
    chance give their median instead, so one odd session is outvoted rather than averaged in."""
    groups = [list(e) for e in earlier if e] + _sessions_of(values, sessions)
    values = [v for g in groups for v in g]
    if len(groups) == 1 or min(values) <= 0:
        return statistics.median(values), median_ci(values, level=level)
    logs = [[math.log(v) for v in g] for g in groups]
    spread_dof = sum(len(g) - 1 for g in logs)
    if spread_dof:  # the rounds' spread about their own session's mean, pooled over sessions
        within = sum((x - statistics.fmean(g)) ** 2 for g in logs for x in g) / spread_dof
    else:
        within = statistics.variance([x for g in logs for x in g])
    medians = [math.log(statistics.median(g)) for g in groups]
    # a median's variance over n rounds is about pi/2 times the mean's
    variances = [max(math.pi / 2 * within / len(g), 1e-12) for g in groups]
    weights = [1 / v for v in variances]
    centre = sum(w * m for w, m in zip(weights, medians, strict=True)) / sum(weights)
    q = sum(w * (m - centre) ** 2 for w, m in zip(weights, medians, strict=True))
    scale = sum(weights) - sum(w * w for w in weights) / sum(weights)
    between = max(0.0, (q - (len(groups) - 1)) / scale)
    weights = [1 / (v + between) for v in variances]
    centre = sum(w * m for w, m in zip(weights, medians, strict=True)) / sum(weights)
    reach = statistics.NormalDist().inv_cdf(0.5 + level / 2) * math.sqrt(1 / sum(weights))
    if len(groups) >= 3 and q > _chi2_95(len(groups) - 1):
        # Sessions that disagree beyond chance (Cochran's Q at 5%) weigh nearly alike, which makes the
        # centre a mean: one session whose process ran 10-50% slow (a few fresh processes do,
        # benchmarks/allocator_pace.py) moved it by a fraction of that however many sessions agreed.
        # Their median outvotes it; its interval is the mean's widened by the median's efficiency
        # (sqrt(pi/2)). Planted, with 12% of processes slow: 43% -> 20% of figures more than 5% off
        # at three sessions (benchmarks/session_outliers.py).
        centre = statistics.median(medians)
        reach *= math.sqrt(math.pi / 2)
    return math.exp(centre), (math.exp(centre - reach), math.exp(centre + reach))


def _chi2_95(dof: int) -> float:
    """The chi-square distribution's 95th percentile at ``dof`` degrees of freedom, by Wilson and
    Hilferty's approximation: within 1% of the exact from 2 on (5.94 against 5.99 at 2, 7.78 against
    7.81 at 3)."""
    z = statistics.NormalDist().inv_cdf(0.95)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def median_ci(
    values: Sequence[float], *, level: float = 0.95, resamples: int = 2000
) -> tuple[float, float] | None:
    """Bootstrap percentile interval of the median of ``values`` (seeded: the same data gives the
    same interval). None below two values: one pair says nothing about its spread."""
    if len(values) < 2:
        return None
    import torch

    # All resamples at once, as counts of each value (a tune asks for thousands of intervals: drawn
    # one value at a time in Python they were a fifth of a planted tune's time). A resample's k-th
    # smallest value is the first of the sorted values whose running count reaches k; its median is
    # statistics.median's (the middle one, or the mean of the middle two).
    n = len(values)
    ordered = torch.tensor(sorted(float(v) for v in values), dtype=torch.float64)
    draws = torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(0))
    running = (
        torch.zeros(resamples, n, dtype=torch.int64).scatter_add_(1, draws, torch.ones_like(draws)).cumsum(1)
    )
    low, high = ((running < k).sum(1) for k in ((n + 1) // 2, n // 2 + 1))
    medians = ((ordered[low] + ordered[high]) / 2).sort().values
    tail = (1 - level) / 2
    return float(medians[int(tail * (resamples - 1))]), float(medians[int((1 - tail) * (resamples - 1))])


# Why the MFU of a row without a FLOP count is n/a (said once per result, not once per row).
NO_FLOPS_NOTE = "MFU n/a: no FLOP count of this train step (torch.utils.flop_counter counts torch's)"


def _mfu(flops: int | None, step_s: float, peak: float | None, source: str) -> tuple[float | None, str]:
    """MFU, or None with the reason when the figure cannot be right (above the peak) or is missing."""
    if flops is None:
        return None, NO_FLOPS_NOTE
    value = mfu(flops, step_s, peak)
    if value is None or value <= 1.0:
        return value, ""
    achieved = achieved_tflops(flops, step_s)
    why = (
        "the measured CPU peak is too low (the machine was busy when it was measured)"
        if source.startswith("measured")
        else "the model's FLOPs overstate the work done (e.g. Winograd/FFT convolutions multiply less)"
    )
    return None, f"n/a: {achieved:.3g} TFLOP/s exceed the {peak / 1e12:.3g} TFLOP/s peak ({value:.0%}): {why}"  # type: ignore[operator]


def _samples(row: BenchRow) -> int:
    return row.world_size * row.batch_size * row.accumulation_steps


PACE_NOTE = "its samples/s say"


def pace_note(paired: float, unpaired: float) -> str:
    """Why a row's interval covers its samples/s ratio: strict fp32 ran at another pace in its rounds."""
    pace = "slower" if paired > unpaired else "faster"
    return (
        f"{PACE_NOTE} {unpaired:.2f}x against strict fp32's over the whole sweep, its paired rounds "
        f"{paired:.2f}x: strict fp32 ran {pace} beside it than over the sweep (the machine's pace moved), so "
        "its interval covers both; a quiet machine, or a re-measure, settles it"
    )


def assemble(
    rows: Iterable[BenchRow], flops_per_step: int | None, peaks: Peaks, between_run_sd: float = 0.0
) -> list[BenchRow]:
    """``rows`` with every derived figure computed from their own measurements and the baseline.

    The speedup of a row with paired ratios is their median with its bootstrap interval (widened to
    cover the ratio of its samples/s to strict fp32's over the sweep where that falls outside, with a
    note: :func:`pace_note`), and where
    a repeat run lands: that interval widened by ``between_run_sd``, the spread between runs of
    log(speedup) on this machine (:func:`mixprec.measure.repeats.widen`; 0: not known); rows
    without (the baseline, data-parallel runs, schema-1 files) fall back on the ratio of
    throughputs. MFU above 100% is never shown as a figure: it becomes None with ``mfu_note``.
    """
    rows = list(rows)
    base = baseline_row(rows)
    out = []
    for row in rows:
        derived: dict[str, Any] = {}
        if row.paired_ratios:
            median, within = session_speedup(row.paired_ratios, row.sessions, earlier=row.earlier)
            unpaired = None
            same = _samples(row) == _samples(base) if base else False
            if row.status == Status.OK and base and base.throughput and row.throughput and same:
                unpaired = row.throughput / base.throughput
            if within and unpaired and not within[0] <= unpaired <= within[1]:
                # one truth: the samples/s a row shows say the same speedup, or its interval covers both
                within = (min(within[0], unpaired), max(within[1], unpaired))
                # (one note, this assembly's: a resumed row may carry a stale one)
                kept = tuple(n for n in row.notes if not n.startswith(PACE_NOTE))
                derived["notes"] = (*kept, pace_note(median, unpaired))
            derived["speedup_vs_fp32"] = median
            derived["speedup_ci"] = within
            if within and median > 0 and between_run_sd > 0:
                derived["repeat_ci"] = widen(median, within, between_run_sd)
        elif row.throughput and base is not None and base.throughput:
            derived["speedup_vs_fp32"] = row.throughput / base.throughput
        st = row.step_time_ms
        if st is not None:
            flops = row.flops_per_step or flops_per_step
            peak, source = peaks.get(row.candidate.spec.peak_key, (None, ""))
            step_s = st.median_ms / 1e3
            utilisation, note = _mfu(flops, step_s, peak, source)
            derived.update(
                flops_per_step=flops,
                achieved_tflops=achieved_tflops(flops, step_s),
                mfu=utilisation,
                mfu_note=note,
                peak_flops=peak,
                peak_flops_source=source,
            )
        out.append(replace(row, **derived))
    return out


@dataclass
class BenchResult:
    """A sweep's rows and the settings they were measured under.

    Attributes:
        workload / description: what was measured.
        device: where.
        batch_size: samples per step (per rank).
        settings: steps, warm-up, threads, pruning, ... as passed to :func:`mixprec.bench`.
        measured: the rows as measured; read :attr:`rows` for them with their derived figures.
        flops_per_step: FLOPs of one training step, counted once per sweep.
        peaks: the peak FLOP/s per compute dtype behind MFU, with their sources.
        env: the environment block (versions, device, precision state).
        notes: what the sweep adjusted or skipped, and why.
        stopped: why the sweep ended before its last candidate (a deadline, or the baseline's
            session ending), else None.
        baseline_ended: why strict fp32's session ended mid-sweep where it did (then ``stopped``
            says so too): not the budget's doing, so no reason to raise it.
        noise: what the machine was doing meanwhile (see :mod:`mixprec.measure.noise`).
        between_run_sd / between_run_basis: the spread between runs of log(speedup) on this
            machine that the rows' intervals include, and where it comes from
            (:mod:`mixprec.measure.repeats`); 0 and '' for a result made without it.
    """

    workload: str
    description: str
    device: str
    batch_size: int
    settings: dict[str, Any]
    measured: list[BenchRow] = field(default_factory=list)
    flops_per_step: int | None = None
    peaks: Peaks = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stopped: str | None = None
    baseline_ended: str | None = None
    noise: dict[str, Any] = field(default_factory=dict)
    between_run_sd: float = 0.0
    between_run_basis: str = ""

    @property
    def rows(self) -> list[BenchRow]:
        return assemble(self.measured, self.flops_per_step, self.peaks, self.between_run_sd)

    def add(self, row: BenchRow) -> None:
        self.measured.append(row)

    def update(self, row: BenchRow) -> None:
        """Replace the measured row with ``row``'s key by ``row`` (e.g. after re-measuring it)."""
        for i, old in enumerate(self.measured):
            if old.key == row.key:
                self.measured[i] = row
                return
        self.measured.append(row)

    @property
    def baseline(self) -> BenchRow | None:
        return baseline_row(self.rows)

    @property
    def baseline_drift(self) -> float | None:
        """Relative change of the strict-fp32 step time from the start of the sweep to its end:
        +0.2 means fp32 steps took 20% longer at the end (the machine got busier or hotter)."""
        rows = self.rows
        first = baseline_row(rows)
        repeat = next((r for r in rows if r.baseline_repeat and r.status == Status.OK), None)
        if first and repeat and first.step_time_ms and repeat.step_time_ms:  # schema 1: a repeat row
            return repeat.step_time_ms.median_ms / first.step_time_ms.median_ms - 1.0
        times = first.step_times_ms if first else ()
        if len(times) < 6:
            return None
        third = len(times) // 3
        return statistics.median(times[-third:]) / statistics.median(times[:third]) - 1.0

    def best(self) -> BenchRow | None:
        ok = [r for r in self.rows if r.status == Status.OK and r.throughput and not r.baseline_repeat]
        return max(ok, key=lambda r: r.throughput or 0.0, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "workload": self.workload,
            "description": self.description,
            "device": self.device,
            "batch_size": self.batch_size,
            "settings": self.settings,
            "flops_per_step": self.flops_per_step,
            "peaks": {k: list(v) for k, v in self.peaks.items()},
            "baseline_drift": self.baseline_drift,
            "notes": self.notes,
            "stopped": self.stopped,
            "baseline_ended": self.baseline_ended,
            "noise": self.noise,
            "between_run": {"sd": self.between_run_sd, "basis": self.between_run_basis},
            "rows": [r.to_dict() for r in self.rows],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        data = check_version(data, "a bench result")
        rows = [BenchRow.from_dict(r) for r in data.get("rows") or []]
        peaks = {k: (v[0], v[1]) for k, v in (data.get("peaks") or {}).items()}
        for row in rows:  # schema 1 kept the peaks on the rows only
            peaks.setdefault(row.candidate.spec.peak_key, (row.peak_flops, row.peak_flops_source))
        flops = data.get("flops_per_step") or next((r.flops_per_step for r in rows if r.flops_per_step), None)
        return cls(
            workload=data.get("workload", ""),
            description=data.get("description", ""),
            device=data.get("device", ""),
            batch_size=data.get("batch_size", 0),
            settings=data.get("settings") or {},
            measured=rows,
            flops_per_step=flops,
            peaks=peaks,
            env=data.get("env") or {},
            notes=list(data.get("notes") or []),
            stopped=data.get("stopped"),
            baseline_ended=data.get("baseline_ended"),
            noise=dict(data.get("noise") or {}),
            between_run_sd=float((data.get("between_run") or {}).get("sd") or 0.0),
            between_run_basis=str((data.get("between_run") or {}).get("basis") or ""),
        )


CSV_COLUMNS = (
    "workload",
    "policy",
    "channels_last",
    "keep_fp32",
    "device",
    "batch_size",
    "status",
    "reason",
    "throughput",
    "step_time_median_ms",
    "step_time_iqr_ms",
    "step_time_n",
    "peak_memory_bytes",
    "speedup_vs_fp32",
    "first_loss",
    "flops_per_step",
    "achieved_tflops",
    "mfu",
    "observed_dtype",
    "baseline_repeat",
)


def write_csv(path: str | os.PathLike[str], rows: list[BenchRow]) -> Path:
    """The rows as CSV, written atomically (see :mod:`mixprec.files`)."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for row in rows:
        d = row.to_dict()
        st = row.step_time_ms
        d.update(
            keep_fp32=";".join(row.keep_fp32),
            step_time_median_ms=st.median_ms if st else None,
            step_time_iqr_ms=st.iqr_ms if st else None,
            step_time_n=st.n if st else None,
        )
        writer.writerow({k: d.get(k) for k in CSV_COLUMNS})
    return atomic_write_text(path, buffer.getvalue(), "--csv file")


def read_csv(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    with Path(path).open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))
