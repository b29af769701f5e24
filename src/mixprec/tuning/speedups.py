"""What a row's speedup is and how well it is known: the figure candidates are ranked by, its
standard error and 95% interval, the noise band two figures must clear to differ, and the two ways
one candidate is measured faster than another (:func:`dominates`, :func:`faster_beyond_noise`).
Pure functions of :class:`~mixprec.measure.results.BenchRow`; :mod:`mixprec.tuning.decide` decides
with them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from mixprec.measure.race import Race
from mixprec.measure.results import BenchRow
from mixprec.measure.settle import sessions_so_far

Speed = Callable[[BenchRow], float]


def speed(row: BenchRow) -> float:
    """What candidates are ranked by: the speedup over strict fp32 (paired when measured so)."""
    return row.speedup_vs_fp32 or 0.0


def log_speed_se(row: BenchRow) -> float:
    """Standard error of log(speedup). Paired rows: their log paired ratios' spread over sqrt(rounds)
    (with the earlier sessions' their figure pools), settled rows at least their interval's (it spans
    their sessions). Unpaired rows (data-parallel,
    schema-1 files): from the step times' IQR (~1.35 sigma; se(median) ~ 0.93 * IQR / median / sqrt(n))."""
    pooled = (*row.paired_ratios, *(r for session in row.earlier for r in session))  # (its record's too)
    ratios = [r for r in pooled if r > 0]
    if len(ratios) >= 2:
        se = statistics.stdev(math.log(r) for r in ratios) / math.sqrt(len(ratios))
        if sessions_so_far(row) < 2 or not row.speedup_ci or min(row.speedup_ci) <= 0:
            return se
        return max(se, math.log(row.speedup_ci[1] / row.speedup_ci[0]) / (2 * Z))
    st = row.step_time_ms
    if not st or not st.median_ms or not st.n:
        return 0.0
    return 0.93 * (st.iqr_ms / st.median_ms) / math.sqrt(st.n)


# About 95% of the sampling noise of a difference lies within two standard errors.
Z = 2.0
# Beyond this relative uncertainty a candidate's speedup is not resolved on this machine: it is set
# aside (and re-measured when the budget allows) instead of widening every comparison with it
# into a tie-break; two resolved candidates' noise band is capped here too.
NOISE_CAP = 0.25


def noise_band(a: BenchRow, b: BenchRow, noise: float) -> float:
    """Relative speed difference between ``a`` and ``b`` that is not real: ``noise``, or two
    combined standard errors of their log speedups if larger (uncapped: compare with NOISE_CAP)."""
    return max(noise, math.expm1(Z * math.hypot(log_speed_se(a), log_speed_se(b))))


def within_noise(speedup: float, best: float, band: float) -> bool:
    return speedup >= best * (1 - min(band, NOISE_CAP))


def raw_interval(row: BenchRow, reference: bool) -> tuple[float, float]:
    """The row's 95% interval of its speedup: its paired rounds' bootstrap interval, else two
    standard errors of log(speedup) either side; a point for the reference (1x by definition)."""
    s = speed(row)
    if reference or s <= 0:
        return s, s
    if row.speedup_ci:
        lo, hi = row.speedup_ci
        return min(lo, s), max(hi, s)
    spread = math.exp(Z * log_speed_se(row))
    return s / spread, s * spread


def uncertainty(row: BenchRow, *, reference: bool = False) -> float:
    """How uncertain ``row``'s speedup is on its own: the relative half-width of its 95% interval
    in log terms (0.3: about +-30%). Above :data:`NOISE_CAP` (and unresolved by a race) the row is
    noisy: set aside by :func:`mixprec.tuning.decide.decide`."""
    lo, hi = raw_interval(row, reference)
    if lo <= 0 or hi <= 0:
        return 0.0 if lo == hi else math.inf
    return math.expm1((math.log(hi) - math.log(lo)) / 2)


def interval(
    row: BenchRow, noise: float = 0.03, *, scale: float = 1.0, reference: bool = False
) -> tuple[float, float]:
    """The speedup interval the decision compares: the 95% interval, never narrower than the noise
    floor around the median (+-``noise``/2, so two candidates closer than ``noise`` always
    overlap), times ``scale`` (a compiled row's amortised over its per-step speedup)."""
    s = speed(row)
    lo, hi = raw_interval(row, reference)
    return min(lo, s * (1 - noise / 2)) * scale, max(hi, s * (1 + noise / 2)) * scale


def dominates(
    faster: BenchRow,
    slower: BenchRow,
    noise: float = 0.03,
    *,
    effective: Speed | None = None,
    race: Race | None = None,
    reference: BenchRow | None = None,
) -> bool:
    """``faster``'s :func:`interval` lies entirely above ``slower``'s: measured apart, however wide
    each is (with ``effective``, compile time amortised). A race that measured the two head to head
    has the last word: dominated only where it found ``faster`` faster."""
    if faster is slower or faster.candidate == slower.candidate:
        return False
    duel = race.duel(faster.candidate, slower.candidate) if race is not None else None
    if duel is not None and duel.resolved:
        return duel.faster() == faster.candidate

    def scaled(row: BenchRow) -> tuple[float, float]:
        s = speed(row)
        scale = effective(row) / s if effective is not None and s else 1.0
        return interval(row, noise, scale=scale, reference=row is reference)

    return scaled(slower)[1] < scaled(faster)[0]


def faster_beyond_noise(
    faster: BenchRow,
    slower: BenchRow,
    noise: float = 0.03,
    *,
    effective: Speed | None = None,
    reference: BenchRow | None = None,
) -> bool:
    """``faster``'s figure (``effective``'s, with compile time amortised) exceeds ``slower``'s by more
    than their noise band: ``noise``, or two combined standard errors, each row's taken from its 95%
    interval: a two-sample test of the two figures at about 95%. Weaker than :func:`dominates`
    (intervals that overlap at their edges can still be two standard errors apart): what lets a
    noisy candidate that is clearly faster win over a slower, well-measured one."""
    figure = effective or speed
    s_fast, s_slow = figure(faster), figure(slower)
    if s_fast <= 0 or s_slow <= 0 or faster.candidate == slower.candidate:
        return False
    return s_fast > s_slow * (1 + interval_band(faster, slower, noise, reference=reference))


def interval_band(a: BenchRow, b: BenchRow, noise: float, *, reference: BenchRow | None = None) -> float:
    """The relative difference between ``a`` and ``b`` that their 95% intervals leave unresolved:
    ``noise``, or two combined standard errors if larger, each row's the one its interval implies
    (half its width in log terms over :data:`Z`; none for ``reference``, 1x by definition). From
    the interval, not the rounds' spread (:func:`log_speed_se`): the interval is what the table
    prints and what :func:`dominates` compares, and a bootstrap interval of 4-8 rounds' median is
    usually the wider of the two (run 21's bf16-mixed: 0.094 against 0.050), which keeps Z = 2
    conservative at so few rounds."""

    def se(row: BenchRow) -> float:  # (an interval reaching zero bounds nothing: inf)
        return math.log1p(uncertainty(row, reference=row is reference)) / Z

    return max(noise, math.expm1(Z * math.hypot(se(a), se(b))))


def amortized(row: BenchRow, baseline: BenchRow | None, train_steps: int | None) -> float:
    """The speedup over a run of ``train_steps`` steps with compilation paid once: strict fp32
    takes N steps of t; the candidate takes its compile time plus N steps of t / speedup. Eager
    candidates (whose cold step costs about what fp32's does) keep their steady speedup."""
    s = speed(row)
    if not train_steps or not row.candidate.compile or not s or baseline is None:
        return s
    base_st, extra = baseline.step_time_ms, row.compile_s
    if base_st is None or not base_st.median_ms or extra is None:
        return s
    run_s = train_steps * base_st.median_ms / 1e3
    return run_s / (extra + run_s / s)
