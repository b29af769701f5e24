"""The row of a candidate trained data-parallel on ``nproc`` ranks (``bench(nproc=N)``, the
backend's runner: torch DDP): global step time is the slowest rank's, memory is per rank. Every
rank must finish for the collectives to complete, so these runs are neither pruned nor paired."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from mixprec.frameworks.session import Measurement
from mixprec.measure.failure import failure_status
from mixprec.measure.results import BenchRow
from mixprec.status import Status


def measure_data_parallel(row: BenchRow, outcome: Any) -> BenchRow:
    """``row`` with the figures of a data-parallel run: the slowest rank's step times, each rank's
    median and peak memory (``outcome``: status, reason, ranks, wall_s, nproc)."""
    if outcome.status != Status.OK or not outcome.ranks:
        status = failure_status(outcome.reason, outcome.reason)  # "OutOfMemoryError: ..."
        return replace(
            row, status=status, reason=outcome.reason, wall_s=outcome.wall_s, world_size=outcome.nproc
        )
    ranks: list[Measurement] = outcome.ranks
    memories = tuple(m.peak_memory_bytes for m in ranks)
    known = [b for b in memories if b is not None]
    first = ranks[0]
    return replace(
        row,
        step_times_ms=tuple(t * 1e3 for t in slowest_rank_step_times(ranks)),
        first_loss=first.first_loss,
        observed_dtype=first.observed_dtype,
        flops_per_step=first.flops_per_step,
        wall_s=outcome.wall_s,
        world_size=outcome.nproc,
        rank_step_time_ms=tuple(rank_medians_ms(ranks)),
        rank_peak_memory_bytes=memories,
        peak_memory_bytes=max(known) if known else None,
        memory_method=(first.memory_method + " (the largest rank)") if known else "n/a",
        first_step_ms=first.warmup_times_s[0] * 1e3 if first.warmup_times_s else None,
    )


def slowest_rank_step_times(ranks: list[Measurement]) -> list[float]:
    """Per step, the slowest rank's time: a data-parallel step ends when the last rank does."""
    return [max(times) for times in zip(*(m.step_times_s for m in ranks), strict=False)]


def rank_medians_ms(ranks: list[Measurement]) -> list[float]:
    return [statistics.median(m.step_times_s) * 1e3 for m in ranks if m.step_times_s]
