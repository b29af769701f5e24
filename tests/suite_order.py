"""The order the suite runs in under pytest-xdist: the longest test modules first on every worker.

``make test`` runs on every core with ``--dist worksteal``: worker ``i`` is sent the ``i``-th
contiguous run of the collection, and a worker that runs out steals the tail of another's queue. In
file order a 50-70 s test (the README's blocks, a tune over a script) could start last on one
worker while the other had nothing left: the run waited for it on one core. Here each worker's run
is filled longest first from the recorded durations (a greedy longest-processing-time split), so
what is stolen and what ends the run are the short tests. The unit is a test module, kept whole and
in its own order: its module-scoped fixtures are made once (a world of one gloo rank that
DeepSpeed caches its groups from, torn down between two halves of its module, failed 13 of its
tests when they were interleaved with others).

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
    its longest modules first. Deterministic (every worker must collect the same order): ties keep
    the collection's order."""
    if workers < 2 or len(items) < workers:
        return list(items)
    modules: dict[str, list[int]] = {}
    for i, test in enumerate(ids):
        modules.setdefault(test.split("::")[0], []).append(i)
    cost = {m: sum(seconds.get(ids[i], UNKNOWN_S) for i in tests) for m, tests in modules.items()}
    room = first_sends(len(items), workers)  # tests each worker is sent first
    runs: list[list[int]] = [[] for _ in range(workers)]
    totals = [0.0] * workers
    for module in sorted(modules, key=lambda m: -cost[m]):
        size = len(modules[module])
        fits = [w for w in range(workers) if room[w] >= size]
        # the least loaded run with room for the whole module, else the one with most room left (its
        # last tests then start the next worker's send, as a module split by a steal does)
        w = (
            min(fits, key=lambda w: (totals[w], w))
            if fits
            else max(range(workers), key=lambda w: (room[w], -w))
        )
        runs[w] += modules[module]
        totals[w] += cost[module]
        room[w] -= size
    return [items[i] for run in runs for i in run]


def store(durations: dict[str, float]) -> None:
    """This run's tests into the file: a test that ran is kept at its new time (dropped under 2 s),
    the ones this run did not run keep theirs."""
    kept = {**recorded(), **{k: round(v, 1) for k, v in durations.items()}}
    kept = {k: v for k, v in sorted(kept.items()) if v >= STORED_FROM_S}
    DURATIONS.write_text(json.dumps(kept, indent=0) + "\n", encoding="utf-8")
