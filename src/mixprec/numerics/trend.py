"""Ranges over the run, and what they predict: the step where a layer will overflow its format.

The costliest mixed-precision failures come late, after the weights have moved: a T5 FFN output
that reaches 66246 after 34 iterations in fp16 (huggingface/transformers#5651), a float8 NaN at
iteration ~80 (pytorch/torchtitan#865). A check of a few steps sees them coming only as a trend:
each layer's largest forward output (and, unscaled, its largest gradient) recorded at every step
of the check (:class:`LayerSeries`), fitted, and extrapolated to the run the user will do.

The fit (:func:`predict`) tries three shapes of growth on the steps after the first (whose
values come from the initial weights): exponential (log2 of the abs-max linear in the step),
power law (linear in log2 of the step: weights that grow linearly under Adam make a deep
layer's output grow like a power of the step) and linear. The shape with the smallest residual
in log space wins; a trend counts only when it is monotone enough (Kendall's tau) and fits well
enough (R^2 in log space). It is never extrapolated further than ``HORIZON`` times the steps it
was fitted on, nor further than ``BITS_FACTOR`` times the bits it grew over them: a crossing
predicted beyond that is "not enough evidence", with the number of check steps that would reach
it (and not even that when it is more than ``UNSURE_MAX_BITS`` away). The thresholds are
calibrated on healthy runs (benchmarks/false_alarms.py) in docs/check.md.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mixprec.numerics.limits import FORMATS

# How far a trend is extrapolated, in multiples of the steps it was fitted on...
HORIZON = 32
# ... and in bits: at most this many times the bits it grew over those steps (an exponential fit of
# a gradient that grows 1.5 bits in 8 steps at the start of training is no evidence of 25 more).
BITS_FACTOR = 4.0
# A crossing further than this many bits away is not worth a "rerun with more steps" either: no
# healthy layer grows 2^16-fold, and bf16 and fp32 keep >100 bits of headroom everywhere.
UNSURE_MAX_BITS = 16.0
# A trend counts when this share of step pairs grows (Kendall's tau) and its fit explains this
# much of the variance of log2(abs-max); calibrated on healthy runs (docs/check.md).
MIN_TAU = 0.6
MIN_R2 = 0.8
# Steps a trend needs at least (after the first).
MIN_POINTS = 4
# A layer whose gradients lose this share of their non-zero values to flush-to-zero is failing:
# a growing underflow share is predicted to reach it (the loss scale no longer covers them).
UNDERFLOW_LIMIT = 0.25
SHAPES = ("exponential", "power", "linear")


@dataclass
class LayerSeries:
    """One layer's ranges at every step of a run.

    Attributes:
        name / type: the module (or Keras layer) and its class.
        forward: its outputs' largest magnitude per step (NaN where it did not run; inf once a
            value overflowed in the run's own format).
        backward: the largest magnitude of the gradient flowing into its outputs per step,
            unscaled (divided by the loss scale of that step); empty where not recorded.
        underflow: the share of those gradients' non-zero values that flush to zero in the run's
            format, as the run holds them (scaled), per step; empty where not recorded.
    """

    name: str
    type: str = ""
    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    underflow: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerSeries:
        return cls(
            str(data["name"]),
            str(data.get("type", "")),
            [float(v) for v in data.get("forward") or []],
            [float(v) for v in data.get("backward") or []],
            [float(v) for v in data.get("underflow") or []],
        )


@dataclass(frozen=True)
class Prediction:
    """Where a trend crosses a limit, and how much the evidence supports it.

    Attributes:
        layer / direction: the layer and "forward" (its outputs) or "backward" (its gradients).
        fmt: the format whose limit is crossed; ``limit`` the magnitude.
        shape: the growth that fitted best (:data:`SHAPES`).
        step: the predicted step of the crossing (counted from 0, as the check's steps are); None
            when the trend never reaches the limit.
        growth_bits: bits of abs-max gained per step at the end of the fitted window.
        gained_bits: bits gained over the fitted window (by the fit).
        headroom_bits: what was left at the last checked step.
        points / tau / r2: the evidence: steps fitted, Kendall's tau, R^2 in log space.
        horizon: the furthest step this evidence may be extrapolated to.
    """

    layer: str
    direction: str
    fmt: str
    limit: float
    shape: str
    step: int | None
    growth_bits: float
    gained_bits: float
    headroom_bits: float
    points: int
    tau: float
    r2: float
    horizon: int

    @property
    def trending(self) -> bool:
        """The growth is real: monotone enough and well fitted."""
        return self.tau >= MIN_TAU and self.r2 >= MIN_R2 and self.growth_bits > 0

    @property
    def within_evidence(self) -> bool:
        """The crossing lies within what the fitted steps support: at most ``HORIZON`` times their
        number of steps away, and at most ``BITS_FACTOR`` times the bits they grew."""
        return (
            self.step is not None
            and self.step <= self.horizon
            and self.headroom_bits <= BITS_FACTOR * max(self.gained_bits, 0.0)
        )

    def steps_needed(self) -> int | None:
        """Check steps whose evidence would reach the predicted crossing (at the growth seen so far:
        an estimate, the rerun re-judges it)."""
        if self.step is None:
            return None
        by_steps = math.ceil((self.step + 1) / HORIZON) + 1
        # n check steps fit steps 1..n-1, which grow about rate * (n - 2) bits and leave
        # headroom_bits - rate * (n - 1 - last) of it (the last fitted step is about ``points``)
        last = self.points
        rate = max(self.growth_bits, 1e-9)
        by_bits = math.ceil((self.headroom_bits / rate + last + 1 + 2 * BITS_FACTOR) / (1 + BITS_FACTOR))
        return max(by_steps, by_bits, self.points + 2)

    def describe(self, train_steps: int, setting: str | None = None) -> str:
        """What is predicted, where, when and on what evidence; ``setting`` names where
        ``train_steps`` comes from (:func:`run_of`; None: the run's own length, said plainly)."""
        evidence = f"{self.points} steps fitted, tau {self.tau:.2f}, R^2 {self.r2:.2f}, {self.shape} growth"
        if self.direction == "underflow":
            now = self.limit / 2**self.headroom_bits
            where = f"layer {self.layer!r}: {now:.1%} of its gradients flush to zero in {self.fmt}"
            crossing = f"predicted to pass {self.limit:.0%}"
        else:
            what = "outputs" if self.direction == "forward" else "gradients"
            where = f"layer {self.layer!r}: its {what}"
            crossing = f"predicted to overflow {self.fmt} (|x| > {self.limit:g})"
        if self.step is None:
            return f"{where}, not {crossing.removeprefix('predicted ')} ({evidence})"
        return (
            f"{where}, {crossing} at about step {self.step} of {run_of(train_steps, setting)} (growing "
            f"{self.growth_bits:.2f} bits/step, {self.headroom_bits:.1f} bits left; {evidence})"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_of(train_steps: int, setting: str | None) -> str:
    """The run a prediction is about, named as the setting it comes from where it is one: check's
    "step 3400 of 10000" read as the length of the user's run where it was --train-steps' default.
    (``mixprec train`` knows its run's length: ``setting`` None, the number alone.)"""
    return f"the {train_steps}-step run ({setting})" if setting else str(train_steps)


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Slope and intercept robust to a stray point (the median of pairwise slopes)."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    slope = statistics.median(slopes) if slopes else 0.0
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))
    return slope, intercept


# Kendall's trend test is exact up to this many points (the null distribution of the number of
# falling pairs, counted); beyond, its normal approximation.
EXACT_TREND_POINTS = 64


@functools.cache
def _falls_at_least(n: int) -> tuple[float, ...]:
    """P(at least k of the n(n-1)/2 pairs fall) for n exchangeable values, for every k: the
    inversion counts of the n! orderings (Mahonian numbers), summed from the top."""
    counts = [1]
    for m in range(2, n + 1):  # the m-th value adds 0..m-1 inversions
        width = len(counts) + m - 1
        prefix = [0, *itertools.accumulate(counts)]
        counts = [prefix[min(k, len(counts) - 1) + 1] - prefix[max(0, k - m + 1)] for k in range(width)]
    total = math.factorial(n)
    tail = list(itertools.accumulate(reversed(counts)))[::-1]
    return tuple(c / total for c in tail)


def falling_p_value(values: Sequence[float]) -> float:
    """One-sided p-value of Kendall's trend test that ``values`` fall with their index: the chance
    that values with no trend (exchangeable noise) fall at least as consistently. A tie counts as
    half a fall (rounded down: the conservative side). 1.0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 1.0
    pairs = [(values[i], values[j]) for i in range(n) for j in range(i + 1, n)]
    falls = sum(1.0 if b < a else 0.5 if b == a else 0.0 for a, b in pairs)
    if n <= EXACT_TREND_POINTS:
        return _falls_at_least(n)[math.floor(falls)]
    mean, var = len(pairs) / 2, n * (n - 1) * (2 * n + 5) / 72
    z = (falls - 0.5 - mean) / math.sqrt(var)  # continuity-corrected
    return 0.5 * math.erfc(z / math.sqrt(2))


def _r2(ys: Sequence[float], fitted: Sequence[float]) -> float:
    mean = statistics.fmean(ys)
    total = sum((y - mean) ** 2 for y in ys)
    residual = sum((y - f) ** 2 for y, f in zip(ys, fitted, strict=True))
    return 1.0 - residual / total if total > 0 else 0.0


@dataclass
class _Series:
    """What a trend is fitted on: the steps from ``start`` whose value is finite and positive, and
    log2 of those values."""

    ts: list[float]
    logs: list[float]


def _series(values: Sequence[float], start: int) -> _Series | None:
    """None with too few points to fit."""
    points = [(t, v) for t, v in enumerate(values) if t >= start and math.isfinite(v) and v > 0]
    if len(points) < MIN_POINTS:
        return None
    return _Series([float(t) for t, _ in points], [math.log2(v) for _, v in points])


@functools.lru_cache(maxsize=64)
def _pairs(n: int) -> torch.Tensor:
    """The index pairs (i < j) of ``n`` points, as two rows."""
    return torch.triu_indices(n, n, 1, device="cpu")


def _medians(rows: torch.Tensor) -> list[list[float]]:
    """The median of each row of ``rows`` (three dimensions) along the last, as
    :func:`statistics.median` gives it (the mean of the two middle values of an even count)."""
    count = rows.shape[-1]
    upper = rows.kthvalue(count // 2 + 1, dim=-1).values.tolist()
    if count % 2:
        return upper
    lower = rows.kthvalue(count // 2, dim=-1).values.tolist()
    return [[(a + b) / 2 for a, b in zip(lo, hi, strict=True)] for lo, hi in zip(lower, upper, strict=True)]


def _pairwise(series: Sequence[_Series]) -> list[tuple[float, float, float, float]]:
    """For each series: the Theil-Sen slope (:func:`theil_sen`'s median of the pairwise slopes)
    of its exponential, power and linear shapes, and Kendall's tau of its logs. These are the
    O(points^2) part of a fit; the series with the same steps (a monitor's layers, sampled
    together) are computed at once, in float64 with the same operations as Python's, so each
    figure is the one the pure-Python fit gives."""
    out: list[tuple[float, float, float, float]] = [(0.0, 0.0, 0.0, 0.0)] * len(series)
    groups: dict[tuple[float, ...], list[int]] = {}
    for k, s in enumerate(series):
        groups.setdefault(tuple(s.ts), []).append(k)
    for ts, members in groups.items():
        n = len(ts)
        i, j = _pairs(n)
        # the shapes' x (steps, log2 of steps) and y (log2 of the values, the values)
        # (on the CPU whatever torch's default device: a few hundred numbers, read back at once)
        x = torch.tensor([ts, [math.log2(t + 1) for t in ts]], dtype=torch.float64, device="cpu")
        logs = [series[k].logs for k in members]
        y = torch.tensor([logs, [[2**v for v in row] for row in logs]], dtype=torch.float64, device="cpu")
        run, rise = x[:, j] - x[:, i], y[:, :, j] - y[:, :, i]
        slopes = torch.stack((rise[0] / run[0], rise[0] / run[1], rise[1] / run[0]), dim=1)
        concordant = torch.sign(rise[0]).sum(dim=-1).tolist()
        pairs = n * (n - 1) // 2
        for (exp, power, linear), c, k in zip(_medians(slopes), concordant, members, strict=True):
            out[k] = (exp, power, linear, c / pairs)
    return out


def _intercept(xs: Sequence[float], ys: Sequence[float], slope: float) -> float:
    return statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))


def predict(
    values: Sequence[float], limit: float, *, layer: str, direction: str, fmt: str, start: int = 1
) -> Prediction | None:
    """Fit the growth of ``values`` (one abs-max per step) from step ``start`` on and find where it
    crosses ``limit``. None with too few finite, positive points to fit."""
    series = _series(values, start)
    if series is None:
        return None
    return _fit(series, _pairwise([series])[0], limit, layer=layer, direction=direction, fmt=fmt)


def _fit(
    series: _Series,
    pairwise: tuple[float, float, float, float],
    limit: float,
    *,
    layer: str,
    direction: str,
    fmt: str,
) -> Prediction:
    """:func:`predict` of ``series`` from its pairwise figures (:func:`_pairwise`)."""
    ts, logs = series.ts, series.logs
    exp_slope, power_slope, linear_slope, tau = pairwise
    target = math.log2(limit)
    last_t, last_log = ts[-1], logs[-1]
    horizon = int(HORIZON * (last_t + 1))
    best: tuple[float, str, float, int | None, float, float] | None = None
    # (residual, shape, r2, step, growth per step, bits gained over the window)
    for shape in SHAPES:
        if shape == "exponential":
            slope = exp_slope
            icpt = _intercept(ts, logs, slope)
            fitted = [icpt + slope * t for t in ts]
            growth = slope
            step = last_t + (target - fitted[-1]) / slope if slope > 0 else None
        elif shape == "power":
            lts = [math.log2(t + 1) for t in ts]
            slope = power_slope
            icpt = _intercept(lts, logs, slope)
            fitted = [icpt + slope * lt for lt in lts]
            growth = slope * (math.log2(last_t + 2) - math.log2(last_t + 1))
            exponent = (target - icpt) / slope if slope > 0 else math.inf
            step = 2**exponent - 1 if exponent < 60 else None  # past 2^60 steps: never
        else:
            vals = [2**y for y in logs]
            slope = linear_slope
            icpt = _intercept(ts, vals, slope)
            fitted = [math.log2(max(icpt + slope * t, 1e-300)) for t in ts]
            end = icpt + slope * last_t
            growth = math.log2((end + slope) / end) if slope > 0 and end > 0 else 0.0
            step = (limit - icpt) / slope if slope > 0 else None
        residual = statistics.median(abs(y - f) for y, f in zip(logs, fitted, strict=True))
        crossing = None if step is None or step > 1e9 else max(int(last_t), math.ceil(step))
        if best is None or residual < best[0]:
            best = (residual, shape, _r2(logs, fitted), crossing, growth, fitted[-1] - fitted[0])
    assert best is not None
    _, shape, r2, crossing, growth, gained = best
    if last_log >= target:
        crossing = int(last_t)  # already past the limit in the checked steps
    return Prediction(
        layer=layer,
        direction=direction,
        fmt=fmt,
        limit=limit,
        shape=shape,
        step=crossing,
        growth_bits=growth,
        gained_bits=gained,
        headroom_bits=target - last_log,
        points=len(ts),
        tau=tau,
        r2=r2,
        horizon=horizon,
    )


@dataclass(frozen=True)
class Outlook:
    """What the ranges over a check say about the run the user will do.

    Attributes:
        at_risk: the earliest crossing within the run that the evidence supports (a verdict).
        unsure: the earliest crossing within the run beyond the evidence's horizon: "not enough
            evidence: rerun with --steps N".
        watched: how many layer series were fitted.
    """

    at_risk: Prediction | None
    unsure: Prediction | None
    watched: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "at_risk": self.at_risk.to_dict() if self.at_risk else None,
            "unsure": self.unsure.to_dict() if self.unsure else None,
            "watched": self.watched,
        }


def outlook(series: Sequence[LayerSeries], fmt: str, train_steps: int, *, start: int = 1) -> Outlook:
    """The earliest predicted failure in ``fmt`` within ``train_steps`` among ``series``: forward
    outputs against the format's largest finite value, unscaled gradients too (a loss scale of 1,
    the scaler's floor, cannot save a gradient past it), and a growing share of gradients flushed
    to zero against :data:`UNDERFLOW_LIMIT`."""
    limit = FORMATS[fmt].max_finite
    supported: list[Prediction] = []
    beyond: list[Prediction] = []
    asked: list[tuple[_Series, float, str, str]] = []  # (series, limit, layer, direction)
    for s in series:
        watch = (("forward", s.forward, limit), ("backward", s.backward, limit))
        for direction, values, bound in (*watch, ("underflow", s.underflow, UNDERFLOW_LIMIT)):
            fitted = _series(values, start)
            if fitted is not None:
                asked.append((fitted, bound, s.name, direction))
    for (fitted, bound, name, direction), pairwise in zip(
        asked, _pairwise([a[0] for a in asked]), strict=True
    ):
        if pairwise[3] < MIN_TAU:
            continue  # not trending whatever the fit (Kendall's tau): the rest of its fit is not needed
        p = _fit(fitted, pairwise, bound, layer=name, direction=direction, fmt=fmt)
        if p.step is None or p.step > train_steps or not p.trending:
            continue
        if p.within_evidence:
            supported.append(p)
        elif p.headroom_bits <= UNSURE_MAX_BITS:
            beyond.append(p)
    # the earliest crossing; of a tie (a wrapper outputs what its last layer does), the innermost layer
    key = lambda p: (p.step, -p.layer.count("."))  # noqa: E731
    return Outlook(min(supported, key=key, default=None), min(beyond, key=key, default=None), len(asked))


def headroom_bits(absmax: float, fmt: str) -> float | None:
    """log2(the format's largest finite value / ``absmax``); -inf past it, None without a value."""
    if not math.isfinite(absmax):
        return -math.inf if absmax == math.inf else None
    if absmax <= 0:
        return None
    return math.log2(FORMATS[fmt].max_finite / absmax)


def least_headroom(series: Sequence[LayerSeries], fmt: str, n: int = 5) -> list[dict[str, Any]]:
    """The ``n`` layers whose headroom in ``fmt`` fell lowest over the run, forward or backward, with
    the step where it did: what the text shows as "least headroom over the checked steps"."""
    rows = []
    for s in series:
        row: dict[str, Any] = {"layer": s.name, "type": s.type, "format": fmt}
        lowest = math.inf
        for direction, values in (("forward", s.forward), ("backward", s.backward)):
            bits = [(b, t) for t, v in enumerate(values) if (b := headroom_bits(v, fmt)) is not None]
            if bits:
                worst, step = min(bits)
                row[f"{direction}_headroom_bits"], row[f"{direction}_step"] = worst, step
                lowest = min(lowest, worst)
        if lowest < math.inf:
            rows.append((lowest, row))
    rows.sort(key=lambda r: r[0])
    return [row for _, row in rows[:n]]
