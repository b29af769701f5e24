"""Paired measurement: each candidate's steps alternate with the strict-fp32 baseline's.

The baseline session stays open for the whole sweep. A candidate is warmed up, then timed in
rounds that alternate with the baseline (ABBA order, so a linear drift hits both alike). A round
is about ``ROUND_S`` seconds of steps per side (one step for models slower than that); its
paired ratio is the baseline's median step time over the candidate's, measured at the same
moment: a neighbour that slows the machine down slows both sides of the pair, so the ratio stays
honest where a sequential sweep would print an impossible speedup. The speedup reported is the
median paired ratio, with a bootstrap interval (:func:`mixprec.measure.results.assemble`).

When a side runs three steps or more in a round, its first is left out of the round: the other
session's OpenMP threads are still spin-waiting right after a switch (measured on a 2-core CPU:
a 1 ms MLP step took 8 ms when the sessions switched after every step).

Pruning compares like with like: a candidate's cold first step against the baseline's cold first
step, its warm steps against what the best candidate would take right now (the baseline's recent
step time over the best paired ratio). A candidate is stopped when one step overruns that limit
by ``prune_factor``, or when two rounds in a row are ``prune_factor`` slower than the best; the
sweep gives every pruned candidate one more attempt at the end, so a transient cannot prune it
for good.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from mixprec import clock
from mixprec.events import Events
from mixprec.frameworks.base import Framework
from mixprec.frameworks.session import BenchSettings, Measurement
from mixprec.measure.isolate import ChildSession, LocalSession, SessionEnded
from mixprec.measure.results import BenchRow
from mixprec.policy import Candidate
from mixprec.status import Status

# Below a second a "hopeless" verdict is process noise, not a measurement.
PRUNE_FLOOR_S = 1.0
# CUDA warm-up steps cost what cuDNN autotuning and lazy kernel loading need (8 to 69 s for
# ResNet-50 at batch 256 on an H100), unrelated to the steady speed: never pruned, only bounded.
CUDA_WARMUP_LIMIT_S = 600.0
# torch.compile's warm-up steps trace and compile (and may recompile on the second step): that
# cost is reported as compile time, amortised by tune, never a reason to prune.
COMPILE_WARMUP_LIMIT_S = 600.0
# A step of the baseline itself: bounded against a hang, never pruned.
BASELINE_LIMIT_S = 600.0
# Seconds of steps per side and round; rounds of short steps batch many of them.
ROUND_S = 0.2
MAX_ROUND_STEPS = 500

SessionHandle = ChildSession | LocalSession


class BaselineEnded(SessionEnded):
    """The baseline's session ended during a candidate's paired rounds: not the candidate's
    failure, and nothing is paired after it (the sweep keeps the rows measured so far)."""


class PairedSweep:
    """The baseline session and the measurement of one candidate after another against it; the
    workload's framework backend builds the sessions (in child processes or in this one)."""

    def __init__(
        self,
        framework: Framework,
        workload: Any,
        settings: BenchSettings,
        *,
        label: str,
        isolate: bool,
        prune_factor: float,
        events: Events,
        should_stop: Callable[[], bool],
        batches: list | None = None,
        reference: Candidate | None = None,
    ) -> None:
        """``reference``: what every candidate is paired with (default: strict fp32, the baseline of
        every speedup); a race pairs finalists with the leader instead."""
        self.framework, self.workload, self.settings, self.label = framework, workload, settings, label
        self.baseline_candidate = reference or framework.baseline
        self.isolate, self.prune_factor = isolate, prune_factor
        self.events, self.should_stop, self.batches = events, should_stop, batches
        self.on_cuda = settings.device.startswith("cuda")
        self.baseline: SessionHandle | None = None
        self.baseline_times: list[float] = []  # every timed baseline step, in order (seconds)
        self.baseline_cold: float | None = None
        self.compiling = False  # the candidate being measured runs under torch.compile
        self.baseline_wall = 0.0
        self.baseline_ended: str | None = None  # why the baseline's session ended early, if it did
        self.best_ratio = 1.0  # the best median paired ratio so far (the baseline itself is 1)

    # ------------------------------------------------------------------ sessions
    def _open(self, candidate: Candidate, settings: BenchSettings) -> SessionHandle:
        # The baseline is never stopped mid-step: every row already measured was timed against it,
        # and it must finish to give its own row (a deadline ends the sweep between candidates).
        stop = self.should_stop if candidate != self.baseline_candidate else (lambda: False)
        framework = self.framework
        own = settings.for_candidate(candidate)
        # the shared batches are the run's size: a candidate with its own micro-batch makes its own
        batches = self.batches if own.batch_size == settings.batch_size else None
        settings = own
        if not self.isolate:
            return LocalSession(
                candidate,
                lambda: framework.session(self.workload, candidate, settings, batches),
                should_stop=stop,
            )
        build = framework.session_builder()
        assert build is not None, f"{framework.title} has no candidate processes (bench refuses isolate)"
        session = ChildSession(
            self.workload.spec,
            candidate,
            settings,
            build=build,
            preload=framework.preload(self.workload.spec),
            should_stop=stop,
        )
        if session.build_output:  # the factory's prints, already shown once by this process
            self.events({"event": "output", "label": candidate.label, "text": session.build_output})
        return session

    def _row(
        self, candidate: Candidate, status: str = Status.OK, reason: str = "", **fields: Any
    ) -> BenchRow:
        own = self.settings.for_candidate(candidate)
        fields.setdefault("accumulation_steps", own.accumulation_steps)
        return BenchRow(self.label, candidate, own.device, own.batch_size, status, reason, **fields)

    def start_baseline(self, count_flops: bool) -> BenchRow:
        """Open, warm up and time the baseline; its row so far (it keeps running for the pairs)."""
        wall = clock.now()
        settings = replace(self.settings, count_flops=count_flops)
        base = self.baseline_candidate
        self.baseline = self._open(base, settings)
        no_limit = lambda index, timed: BASELINE_LIMIT_S  # noqa: E731
        warm = self.baseline.warm_up(no_limit, self._emit(base))
        self.baseline_cold = warm[0] if warm else None
        self.baseline_times += self.baseline.steps(self.settings.steps, no_limit, self._emit(base))
        self.baseline_wall = clock.now() - wall
        return self._row(base, step_times_ms=_ms(self.baseline_times), first_step_ms=_ms1(self.baseline_cold))

    def finish_baseline(self) -> BenchRow:
        """Close the baseline session; its row over every step it timed during the sweep (also when
        the session ended early: the steps it timed were timed)."""
        row = self._row(
            self.baseline_candidate,
            step_times_ms=_ms(self.baseline_times),
            first_step_ms=_ms1(self.baseline_cold),
        )
        if self.baseline is None:
            assert self.baseline_ended is not None, "finish_baseline before start_baseline"
            note = f"its session ended during the sweep ({self.baseline_ended}): the steps timed before"
            return replace(row, wall_s=self.baseline_wall, notes=(*row.notes, note))
        try:
            measurement = self.baseline.finish()
        except SessionEnded as ended:  # (at its last word: the rows paired with it stand)
            self.baseline = None
            note = f"its session ended as it was stopped ({ended.reason}): no peak memory"
            return replace(row, wall_s=self.baseline_wall, notes=(*row.notes, note))
        self.baseline = None
        return _with(row, measurement, wall_s=self.baseline_wall)

    def _baseline_round(self, n: int) -> float:
        """Run ``n`` baseline steps; their median (the first left out when ``n >= 3``).
        :class:`BaselineEnded` where the baseline's session ends."""
        assert self.baseline is not None
        try:
            times = self.baseline.steps(n, lambda index, timed: BASELINE_LIMIT_S, lambda event: None)
        except SessionEnded as ended:
            self.baseline.close()
            self.baseline, self.baseline_ended = None, ended.reason
            base = self.baseline_candidate
            who = "strict fp32" if base == self.framework.baseline else base.label  # (a race's leader)
            raise BaselineEnded(
                ended.status, f"{who}'s session ended: {ended.reason}", traceback=ended.traceback
            ) from ended
        kept = _settled(times)
        self.baseline_times += kept
        return statistics.median(kept)

    def _recent_baseline(self) -> float:
        return statistics.median(self.baseline_times[-3:])

    def _emit(self, candidate: Candidate) -> Callable[[dict[str, Any]], None]:
        total = self.settings.warmup + self.settings.steps
        return lambda event: self.events(
            {**event, "label": candidate.label, "total": max(total, event["index"] + 1)}
        )

    # ------------------------------------------------------------------ one candidate
    def _limit(self, index: int, timed: bool) -> float | None:
        """Seconds a candidate's step may take before it counts as hopeless (see the module doc)."""
        if self.on_cuda and not timed:
            return CUDA_WARMUP_LIMIT_S
        if self.compiling and not timed:
            return COMPILE_WARMUP_LIMIT_S
        if index == 0 and self.baseline_cold:
            return max(PRUNE_FLOOR_S, self.prune_factor * self.baseline_cold)
        best_now = self._recent_baseline() / self.best_ratio
        settling = 1 if timed else 3  # later warm-up steps may still be settling: a wider margin
        return max(PRUNE_FLOOR_S, self.prune_factor * settling * best_now)

    def measure(self, candidate: Candidate) -> BenchRow:
        """Warm ``candidate`` up and time it in rounds paired with the baseline; never raises for
        the candidate's own failures (they become the row's status). :class:`SessionEnded` with
        status 'stopped', and :class:`BaselineEnded`, propagate: the sweep ends there."""
        wall = clock.now()
        session: SessionHandle | None = None
        times: list[float] = []
        ratios: list[float] = []
        cold: list[float] = []
        try:
            self.compiling = candidate.compile is not None
            session = self._open(candidate, self.settings)
            emit = self._emit(candidate)
            warm = session.warm_up(self._limit, emit)
            cold = warm[:1]
            strikes = 0
            n_base = _round_steps(self._recent_baseline())
            n_cand = _round_steps(warm[-1] if warm else self._recent_baseline())
            while len(ratios) < self.settings.steps or (
                sum(times) < self.settings.min_time_s and len(times) < self.settings.max_steps
            ):
                if len(ratios) % 2 == 0:  # ABBA: baseline first in even rounds, the candidate first in odd
                    base = self._baseline_round(n_base)
                    steps = _settled(session.steps(n_cand, self._limit, emit))
                else:
                    steps = _settled(session.steps(n_cand, self._limit, emit))
                    base = self._baseline_round(n_base)
                times += steps
                ratios.append(base / statistics.median(steps))
                strikes = strikes + 1 if ratios[-1] * self.prune_factor < self.best_ratio else 0
                if strikes >= 2:
                    raise SessionEnded(
                        "pruned",
                        f"two paired rounds at least {self.prune_factor:g}x slower than the best candidate "
                        f"(paired speedup {ratios[-1]:.2f}x against the best {self.best_ratio:.2f}x)",
                        times,
                    )
            measurement = session.finish()
        except SessionEnded as ended:
            if session is not None:
                session.close()
            if ended.status == "stopped" or isinstance(ended, BaselineEnded):
                raise
            status = Status(ended.status)
            reason = ended.reason
            if status == Status.PRUNED:
                reason += f" (strict fp32 took {self._recent_baseline():.2f} s per step meanwhile)"
            if status == Status.OOM and self.on_cuda:
                torch.cuda.empty_cache()
            seen = times or ended.steps  # a pruned row keeps the figure it reached
            return self._row(
                candidate,
                status,
                reason,
                step_times_ms=_ms(seen) if status == Status.PRUNED else (),
                paired_ratios=tuple(ratios) if status == Status.PRUNED else (),
                first_step_ms=_ms1(cold[0] if cold else (ended.steps[0] if ended.steps else None)),
                wall_s=clock.now() - wall,
                error_traceback=ended.traceback,
            )
        median_ratio = statistics.median(ratios)
        self.best_ratio = max(self.best_ratio, median_ratio)
        row = self._row(
            candidate,
            step_times_ms=_ms(times),
            paired_ratios=tuple(ratios),
            first_step_ms=_ms1(cold[0] if cold else None),
        )
        return _with(row, measurement, wall_s=clock.now() - wall)

    def close(self) -> None:
        if self.baseline is not None:
            self.baseline.close()
            self.baseline = None


def _round_steps(step_s: float) -> int:
    return max(1, min(MAX_ROUND_STEPS, round(ROUND_S / max(step_s, 1e-6))))


def _settled(times: list[float]) -> list[float]:
    """A round's step times without the first when there are three or more (see the module doc)."""
    return times[1:] if len(times) >= 3 else times


def _ms(seconds: list[float]) -> tuple[float, ...]:
    return tuple(t * 1e3 for t in seconds)


def _ms1(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _with(row: BenchRow, m: Measurement, **extra: Any) -> BenchRow:
    """``row`` with what the run's measurement saw (first loss, dtype, memory, FLOPs)."""
    out = replace(
        row,
        first_loss=m.first_loss,
        observed_dtype=m.observed_dtype,
        peak_memory_bytes=m.peak_memory_bytes,
        memory_method=m.memory_method,
        flops_per_step=m.flops_per_step,
        graph_breaks=m.graph_breaks,
        graphs=m.graphs,
        recompiles=m.recompiles,
        compute_share=m.compute_share,
        optimizer_share=m.optimizer_share,
        notes=(*row.notes, *m.notes),
        **extra,
    )
    if m.trace_s is not None and out.first_step_ms is not None:  # what the first step cost a user
        out = replace(out, first_step_ms=out.first_step_ms + m.trace_s * 1e3)
    if out.first_loss is not None and out.first_loss != out.first_loss:  # NaN
        out = replace(out, status=Status.ERROR, reason=f"non-finite first loss {out.first_loss}")
    return out
