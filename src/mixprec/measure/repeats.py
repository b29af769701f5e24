"""One truth for one configuration: where a repeat of a speedup measurement lands on this machine.

A sweep pairs a candidate's steps with strict fp32's, and the bootstrap interval of the paired
ratios' median covers the noise within that run. A repeat in fresh processes lands further away:
its rounds shared their processes, their memory layout and thread placement, and the machine's
state of the moment. ResNet-50 (128 px, batch 16) bf16-mixed+cl+compile-step, ``mixprec.bench``
three times back to back on the quiet 2-core AMD EPYC: 1.963x [1.86-2.08], 1.829x [1.75-1.85] and
1.854x [1.82-1.90], the first outside both other intervals (and 1.956x [1.94-1.99] earlier that
day). An interval that excludes a repeat measurement is a bug in the interval.

So a speedup's interval is where a repeat of it on this machine lands, 19 times in 20: the run's
own noise and the spread between runs, for both measurements (:func:`widen`). The spread between
runs is learned on this machine from the speedups it measured more than once (``repeats.json`` in
mixprec's cache, per device; every sweep paired with strict fp32 records its rows), pooled over
configurations as a one-way random-effects estimate, and shrunk towards :data:`BETWEEN_RUN_SD` (the
EPYC's 3.2% above) with :data:`PRIOR_DF` degrees of freedom until the machine has its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from mixprec.files import read_json_cache, write_json_cache
from mixprec.hardware.peaks import default_cache_dir

# The spread between runs of log(speedup) before this machine has repeats of its own: the 2-core
# AMD EPYC's, from the four ResNet-50 runs in the module docstring (their own noise taken out).
BETWEEN_RUN_SD = 0.032
# How many degrees of freedom the prior weighs, against the machine's own repeats.
PRIOR_DF = 4
# About 95% of a normal spread lies within this many standard deviations.
Z = 1.96
# Runs kept per configuration (the latest): the machine, torch and the workload change over time.
KEPT = 8
_VERSION = 1


def within_run_se(low: float, high: float) -> float:
    """The standard error of log(speedup) a 95% interval ``[low, high]`` stands for."""
    return math.log(high / low) / (2 * Z)


def widen(median: float, interval: tuple[float, float], between_run_sd: float) -> tuple[float, float]:
    """Where a repeat of a speedup measured as ``median`` with the within-run ``interval`` lands (95%),
    given the spread between runs: each side's log half-width h becomes sqrt(2 (h^2 + (Z sd)^2)),
    the spread of a difference between two runs alike (the repeat has its own noise and its own
    run). ``between_run_sd`` 0 leaves the interval as it is."""
    if between_run_sd <= 0:
        return interval
    low, high = interval
    spread = (Z * between_run_sd) ** 2

    def side(h: float) -> float:
        return math.sqrt(2 * (h * h + spread))

    return median * math.exp(-side(math.log(median / low))), median * math.exp(side(math.log(high / median)))


def pooled_between_run_sd(runs: Sequence[Sequence[tuple[float, float]]]) -> tuple[float, int]:
    """The spread between runs of log(speedup) and its degrees of freedom, from ``runs``: per
    configuration, each run's (log speedup, within-run standard error). A one-way random-effects
    estimate: the spread of a configuration's runs about their mean, less what their own noise
    explains, pooled over the configurations measured more than once; never below 0."""
    squares = noise = 0.0
    df = 0
    for config in runs:
        if len(config) < 2:
            continue
        mean = sum(v for v, _ in config) / len(config)
        squares += sum((v - mean) ** 2 for v, _ in config)
        noise += (len(config) - 1) * sum(se * se for _, se in config) / len(config)
        df += len(config) - 1
    if not df:
        return 0.0, 0
    return math.sqrt(max(0.0, (squares - noise) / df)), df


class Repeats:
    """The speedups this machine measured, per device and configuration (``repeats.json``). Never
    raises on a bad file: it reads as empty with one :class:`CacheWarning`, and a file that cannot
    be written is a warning too (the spread is learned from it, no result depends on its being
    kept)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_cache_dir() / "repeats.json"
        self.devices = self._read()

    def _read(self) -> dict[str, dict[str, list[list[float]]]]:
        good: dict[str, dict[str, list[list[float]]]] = {}
        for device, configs in read_json_cache(
            self.path, "repeat measurement cache", _VERSION, "devices"
        ).items():
            if not isinstance(configs, dict):
                continue
            for key, runs in configs.items():
                kept = [r for r in runs if _run(r)] if isinstance(runs, list) else []
                if kept:
                    good.setdefault(device, {})[key] = [[float(v), float(se)] for v, se in kept]
        return good

    def between_run_sd(self, device: str) -> tuple[float, str]:
        """The spread between runs of log(speedup) on ``device``, and where it comes from: this
        machine's repeats, weighed against the prior (:data:`BETWEEN_RUN_SD`) by their degrees of
        freedom."""
        runs = [[(v, se) for v, se in r] for r in self.devices.get(device, {}).values()]
        own, df = pooled_between_run_sd(runs)
        sd = math.sqrt((PRIOR_DF * BETWEEN_RUN_SD**2 + df * own**2) / (PRIOR_DF + df))
        if not df:
            return sd, "the prior: no speedup was measured twice on this machine yet"
        return sd, (
            f"{own:.1%} from {df} repeat{'s' if df > 1 else ''} measured on this machine, weighed with the "
            f"{BETWEEN_RUN_SD:.1%} prior ({PRIOR_DF} degrees of freedom)"
        )

    def record(self, device: str, key: str, speedup: float, interval: tuple[float, float]) -> None:
        """Add one run's ``speedup`` of configuration ``key`` on ``device`` (the median of its
        paired ratios) and the within-run standard error its bootstrap ``interval`` stands for;
        :meth:`save` keeps what a sweep added, once."""
        if not (speedup > 0 and interval[0] > 0):
            return
        runs = self.devices.setdefault(device, {}).setdefault(key, [])
        runs.append([math.log(speedup), within_run_se(*interval)])
        del runs[:-KEPT]

    def save(self) -> None:
        """Write the runs kept (a warning where the file cannot be written)."""
        write_json_cache(self.path, "repeat measurements", _VERSION, "devices", self.devices)


def _run(entry: object) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 2
        and all(isinstance(v, int | float) and math.isfinite(v) for v in entry)
        and entry[1] >= 0
    )
