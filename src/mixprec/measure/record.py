"""One record per configuration on this machine: the figure the next command repeats (issue 53).

A settled figure pools a row's rounds over sessions in fresh processes until its interval is
narrow (:mod:`mixprec.measure.settle`), because each process has a pace of its own: on the 2-core
AMD EPYC six fresh processes of 8 rounds each read 1.66-2.01x for one pair (``fresh_processes/``).
A command can pay for a few sessions; the machine has measured the same configuration before, in
other processes and other minutes, and those sessions are as good as the command's own. So every
paired session is kept here (``record.json`` in mixprec's cache, per device and configuration, the
latest :data:`KEPT`), and a settled figure pools the latest :data:`POOLED` of them with its own, by
the rule it pools its own sessions with (:func:`~mixprec.measure.results.session_speedup`).
Replayed over bench_vs_tune's 28 runs on the EPYC (``benchmarks/pooled_record.py``): tune's figure,
bench's and plain PyTorch's within 10% of each other in 17 of 28 runs as printed, 26 of 28 pooled.

What keeps a record from answering for something else:

- a configuration is everything that changes the figure (:func:`configuration`: the workload and its
  sizes, the batch, threads, isolation, torch and mixprec versions, the candidate), not how long it
  was sampled (steps, warm-up), so tune's sweep and bench's sessions of one candidate share one;
- only workloads built from a name and sizes are recorded (:func:`poolable`): a model or a script of
  the user's own can change under the same name;
- a session older than :data:`MAX_AGE_S` is not pooled (the machine under it may have changed);
- a record the command's own figure lies far outside of (beyond the spread of one session's figure,
  an odd process included) is not pooled at all (:func:`agreeing`): something changed under the
  same configuration, and the command's figure is its own.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mixprec.files import read_json_cache, write_json_cache
from mixprec.hardware.peaks import default_cache_dir
from mixprec.measure.results import BenchResult, own_sessions, session_speedup
from mixprec.policy import Candidate
from mixprec.status import Status

# Sessions kept per configuration (the latest), and how many of them a figure pools at most: the
# replay kept 8 (4: 23 of 28 runs within 10%; 16: 25 of 28). More are kept than pooled because a
# command's own sessions are kept too, and never pooled as earlier ones.
KEPT = 16
POOLED = 8
# A session older than this is not pooled.
MAX_AGE_S = 24 * 3600.0
# How far a run's own figure may lie from the record's sessions, in standard deviations of one
# session's figure about them, before the record is taken to be of something else: about 0.3% of an
# unchanged configuration's runs lie further (normal), and a change of about 25% is seen.
DISAGREE_Z = 3.0
# The spread (sd of log speedup) of one session's figure that the record's own is not taken below:
# on the EPYC a fresh process's pace alone moved one pair's figure 6.5% (``fresh_processes/``).
SESSION_SD = 0.065
# How long a configuration was sampled: not what its figure is a figure of.
SAMPLING = ("steps", "warmup", "min_time_s", "prune_factor")
_VERSION = 1

Sessions = tuple[tuple[float, ...], ...]


def configuration(settings: dict[str, Any], description: str, candidate: Candidate) -> str:
    """The record's key for ``candidate`` measured under ``settings`` (a sweep's resume key) of the
    workload ``description`` describes, less how long it was sampled (:data:`SAMPLING`)."""
    kept = {k: v for k, v in settings.items() if k not in SAMPLING}
    text = json.dumps(
        {**kept, "description": description, "candidate": candidate.to_dict()}, sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def poolable(framework_name: str, workload: Any) -> bool:
    """Whether ``workload``'s figures are recorded and pooled: one built from its name and sizes
    (``load_workload``, the zoo), whose label says what runs; not a model or script of the user's
    own, which can change under the same name."""
    return getattr(workload, "spec", None) is not None and framework_name != "script"


def agreeing(own: Sequence[float], sessions: Sequence[int], earlier: Sessions) -> Sessions:
    """``earlier`` where the row's own rounds (``own``, in ``sessions``) agree with it, else none: a
    run whose figure lies further from the record's sessions than :data:`DISAGREE_Z` times a
    session's spread about them (that spread as the record's sessions show it, never below
    :data:`SESSION_SD`) measured something else under the same configuration (an environment
    variable, an allocator, a changed machine). An odd process is not that: it is what pooling is
    for, and a session's spread includes it."""
    if not earlier or not own:
        return earlier
    medians = [math.log(statistics.median(s)) for s in earlier]
    centre = statistics.fmean(medians)
    spread = max(statistics.stdev(medians) if len(medians) > 1 else 0.0, SESSION_SD)
    figure = math.log(session_speedup(own, sessions)[0])
    return earlier if abs(figure - centre) <= DISAGREE_Z * spread * math.sqrt(1 + 1 / len(medians)) else ()


def disagreed(earlier: Sessions) -> str:
    """The note on a row whose own sessions disagreed with the record of ``earlier`` sessions."""
    values = [v for s in earlier for v in s]
    figure, _ = session_speedup(values, [len(s) for s in earlier])
    return (
        f"not pooled with this machine's {len(earlier)} earlier session{'s' if len(earlier) > 1 else ''} "
        f"of it ({figure:.2f}x): this run's figure lies beyond their spread (something changed under "
        "the same configuration: an environment variable, an allocator, the machine)"
    )


class Record:
    """The paired sessions this machine measured, per device and configuration (``record.json``).
    Never raises on a bad file: it reads as empty with one
    :class:`~mixprec.errors.CacheWarning`; one that cannot be written is a warning too."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_cache_dir() / "record.json"
        self.devices = self._read()

    def _read(self) -> dict[str, dict[str, list[dict[str, Any]]]]:
        good: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for device, configs in read_json_cache(self.path, "speedup record", _VERSION, "devices").items():
            if not isinstance(configs, dict):
                continue
            for key, entries in configs.items():
                kept = [e for e in entries if _entry(e)] if isinstance(entries, list) else []
                if kept:
                    good.setdefault(device, {})[key] = kept
        return good

    def earlier(
        self, device: str, key: str, own: Sequence[Sequence[float]], now: float | None = None
    ) -> Sessions:
        """The latest :data:`POOLED` sessions of configuration ``key`` on ``device``, measured within
        :data:`MAX_AGE_S` of ``now``, the row's ``own`` sessions aside (they are recorded too)."""
        now = time.time() if now is None else now
        mine = {tuple(s) for s in own}
        found = [
            rounds
            for e in self.devices.get(device, {}).get(key, [])
            if now - e["at"] <= MAX_AGE_S and (rounds := tuple(e["rounds"])) not in mine
        ]
        return tuple(found[-POOLED:])

    def add(self, device: str, key: str, rounds: Sequence[float], at: float | None = None) -> None:
        """Keep one session's paired rounds of configuration ``key`` on ``device``; :meth:`save`
        writes what was added."""
        if not rounds or not all(_positive(v) for v in rounds):
            return
        entries = self.devices.setdefault(device, {}).setdefault(key, [])
        entries.append({"rounds": [float(v) for v in rounds], "at": time.time() if at is None else at})
        del entries[:-KEPT]

    def save(self) -> None:
        write_json_cache(self.path, "speedup record", _VERSION, "devices", self.devices)


def _positive(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _entry(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    rounds, at = entry.get("rounds"), entry.get("at")
    return (
        isinstance(rounds, list)
        and bool(rounds)
        and all(_positive(v) for v in rounds)
        and isinstance(at, int | float)
        and math.isfinite(at)
    )


def keep(device: str, settings: dict[str, Any], result: BenchResult, resumed: set[tuple], pool: bool) -> None:
    """Each session a sweep measured (``result``, under its resume key ``settings``) into the
    machine's record; with ``pool``, onto each measured row the earlier sessions of its
    configuration its own agree with (:func:`agreeing`): what its figure pools. A row read back
    from the stream by a resume (its key in ``resumed``) is the session it was, not another."""
    kept = Record()
    for row in result.measured:
        if row.status != Status.OK or row.baseline_repeat or not row.paired_ratios:
            continue
        config = configuration(settings, result.description, row.candidate)
        own = own_sessions(row)
        if row.key not in resumed:
            for session in own:
                kept.add(device, config, session)
        if pool:
            earlier = kept.earlier(device, config, own)
            pooled = agreeing(row.paired_ratios, row.sessions, earlier)
            notes = row.notes + ((disagreed(earlier),) if earlier and not pooled else ())
            result.update(replace(row, earlier=pooled, notes=notes))
    kept.save()
