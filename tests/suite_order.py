"""The order the suite runs in under pytest-xdist: the longest tests first on every worker.

``make test`` runs on every core with ``--dist worksteal``: worker ``i`` is sent the ``i``-th
contiguous run of the collection, and a worker that runs out steals the tail of another's queue. In
file order a 50-70 s test (the README's blocks, a tune over a script) could start last on one
worker while the other had nothing left: the run waited for it on one core. Here each worker's run
is filled longest first from the recorded durations (a greedy longest-processing-time split), so
what is stolen and what ends the run are the short tests.

``durations.json`` holds each test that took 2 s or more in a full run (seconds; a test it does not
name counts 1 s). Only the order depends on it: a stale file makes the run slower, never different.
Refresh it with ``MIXPREC_STORE_DURATIONS=1 make test``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_S = 1.0  # a test the file does not name (new, or under 2 s when it was written)
STORED_FROM_S = 2.0

T = TypeVar("T")


def recorded() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text(encoding="utf-8")).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def first_sends(n: int, workers: int) -> list[int]:
    """How many tests worksteal sends each worker first: ``len(pending) // workers_left``, in turn."""
    sizes, left = [], n
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def longest_first(items: Sequence[T], ids: Sequence[str], workers: int, seconds: dict[str, float]) -> list[T]:
    """``items`` reordered so that each worker's first send is balanced in recorded time and runs
    longest first; ties keep the collection's order (a stable, deterministic order: every worker
    must collect the same one)."""
    if workers < 2 or len(items) < workers:
        return list(items)
    by_length = sorted(range(len(items)), key=lambda i: -seconds.get(ids[i], UNKNOWN_S))
    capacity = first_sends(len(items), workers)
    runs: list[list[int]] = [[] for _ in range(workers)]
    totals = [0.0] * workers
    for i in by_length:
        open_runs = [w for w in range(workers) if len(runs[w]) < capacity[w]]
        w = min(open_runs, key=lambda w: (totals[w], w))
        runs[w].append(i)
        totals[w] += seconds.get(ids[i], UNKNOWN_S)
    return [items[i] for run in runs for i in run]


def store(durations: dict[str, float]) -> None:
    """This run's tests into the file: a test that ran is kept at its new time (dropped under 2 s),
    the ones this run did not run keep theirs."""
    kept = {**recorded(), **{k: round(v, 1) for k, v in durations.items()}}
    kept = {k: v for k, v in sorted(kept.items()) if v >= STORED_FROM_S}
    DURATIONS.write_text(json.dumps(kept, indent=0) + "\n", encoding="utf-8")
