"""The trend behind `at-risk`: fits that find the crossing step, refuse to extrapolate past their
evidence, and stay quiet on the noise of a healthy run."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from mixprec.numerics import trend
from mixprec.numerics.limits import FORMATS
from mixprec.numerics.trend import (
    HORIZON,
    UNDERFLOW_LIMIT,
    UNSURE_MAX_BITS,
    LayerSeries,
    Outlook,
    headroom_bits,
    least_headroom,
    outlook,
    predict,
    theil_sen,
)

FP16_MAX = FORMATS["fp16"].max_finite


def test_linear_growth_is_predicted_to_cross_where_it_will():
    values = [1000.0 + 450.0 * t for t in range(12)]  # crosses 65504 at t = 143.3
    p = predict(values, FP16_MAX, layer="head", direction="forward", fmt="fp16")
    assert p is not None and p.trending and p.within_evidence
    assert p.shape == "linear"
    assert 140 <= p.step <= 148, p.step
    assert "layer 'head': its outputs, predicted to overflow fp16" in p.describe(10_000)
    # the run's length named as the setting it is (10000 is --train-steps' default, not the user's run)
    assert f"at about step {p.step} of the 10000-step run (--train-steps)" in p.describe(
        10_000, "--train-steps"
    )
    # a run whose length is known (mixprec train's --steps): the number alone
    assert f"at about step {p.step} of 500 (" in p.describe(500)


def test_exponential_growth_is_fitted_as_such():
    values = [2.0 ** (0.5 * t) for t in range(10)]  # crosses 2^16 near t = 32
    p = predict(values, FP16_MAX, layer="ffn", direction="forward", fmt="fp16")
    assert p is not None and p.shape == "exponential"
    assert p.growth_bits == pytest.approx(0.5)
    assert 30 <= p.step <= 33


def test_a_crossing_past_the_horizon_is_not_enough_evidence():
    values = [1.0 + 0.01 * t for t in range(8)]  # linear: reaches 65504 after ~6.5 million steps
    p = predict(values, FP16_MAX, layer="x", direction="forward", fmt="fp16")
    assert p is not None and not p.within_evidence
    assert p.horizon == HORIZON * 8
    # a crossing within the run but past the horizon is "unsure", never at-risk
    slow = [1000.0 + 30.0 * t for t in range(8)]  # crosses at ~2150, the horizon is 256
    seen = outlook([LayerSeries("x", forward=slow)], "fp16", 10_000)
    assert seen.at_risk is None and seen.unsure is not None
    assert seen.unsure.steps_needed() == math.ceil((seen.unsure.step + 1) / HORIZON) + 1


def test_a_fast_start_is_not_extrapolated_past_four_times_the_bits_it_grew():
    # a gradient growing 0.22 bits a step over the first 8 steps of training (zoo mlp, fp16): 25 bits
    # from fp16's limit, it would cross at step ~125, well within 32x the steps, but 25 bits are far
    # more than 4x the 1.5 it grew: no verdict, and too far away to ask for a rerun
    values = [2.0 ** (-9.5 + 0.22 * t) for t in range(8)]
    p = predict(values, FP16_MAX, layer="0", direction="backward", fmt="fp16")
    assert p is not None and p.trending and p.step is not None and p.step <= p.horizon
    assert p.gained_bits == pytest.approx(0.22 * 6) and not p.within_evidence
    seen = outlook([LayerSeries("0", backward=values)], "fp16", 10_000)
    assert seen.at_risk is None and seen.unsure is None
    # 12 bits away: not enough evidence, and the steps that would reach it
    closer = [2.0 ** (2.0 + 0.22 * t) for t in range(8)]
    seen = outlook([LayerSeries("0", backward=closer)], "fp16", 10_000)
    assert seen.at_risk is None and seen.unsure is not None
    needed = seen.unsure.steps_needed()
    longer = [2.0 ** (2.0 + 0.22 * t) for t in range(needed)]
    assert outlook([LayerSeries("0", backward=longer)], "fp16", 10_000).at_risk is not None


def test_noise_around_a_level_is_not_a_trend():
    rng = random.Random(0)
    values = [100.0 * (1 + 0.2 * rng.uniform(-1, 1)) for _ in range(16)]
    p = predict(values, FP16_MAX, layer="x", direction="forward", fmt="fp16")
    assert p is not None and not p.trending
    assert outlook([LayerSeries("x", forward=values)], "fp16", 10_000).at_risk is None


def test_the_first_step_and_missing_values_are_not_fitted():
    assert (
        predict([1.0, math.nan, 2.0, math.nan], FP16_MAX, layer="x", direction="forward", fmt="fp16") is None
    )
    # a huge first step (the initial weights') does not hide the growth after it
    values = [60000.0] + [1000.0 + 450.0 * t for t in range(1, 12)]
    p = predict(values, FP16_MAX, layer="x", direction="forward", fmt="fp16")
    assert p is not None and p.trending and 140 <= p.step <= 148


def test_a_power_law_that_never_crosses_does_not_overflow_the_arithmetic():
    # a power law with a tiny exponent: 2^exponent would overflow a float; it is "never", not an error
    values = [1e-3 * (t + 1) ** 1e-6 for t in range(10)]
    p = predict(values, FP16_MAX, layer="x", direction="forward", fmt="fp16")
    assert p is None or p.step is None or p.step > 1e6


def test_a_growing_underflow_share_is_predicted_to_pass_its_limit():
    shares = [0.01 + 0.01 * t for t in range(10)]  # 25% at t = 24
    seen = outlook([LayerSeries("embed", underflow=shares)], "fp16", 10_000)
    assert seen.at_risk is not None and seen.at_risk.direction == "underflow"
    assert 22 <= seen.at_risk.step <= 26
    text = seen.at_risk.describe(10_000)
    assert "flush to zero in fp16" in text and f"predicted to pass {UNDERFLOW_LIMIT:.0%}" in text


def test_gradients_and_outputs_both_count_and_the_earliest_wins():
    late = LayerSeries("a", forward=[1000.0 + 100.0 * t for t in range(12)])
    early = LayerSeries("b", backward=[1000.0 + 900.0 * t for t in range(12)])
    seen = outlook([late, early], "fp16", 10_000)
    assert seen.at_risk is not None and (seen.at_risk.layer, seen.at_risk.direction) == ("b", "backward")
    assert seen.watched == 2


def test_least_headroom_names_the_layer_and_the_step():
    rows = least_headroom(
        [LayerSeries("a", forward=[1.0, 2.0, 4.0]), LayerSeries("b", forward=[8192.0, 1.0])], "fp16"
    )
    assert [r["layer"] for r in rows] == ["b", "a"]
    assert rows[0]["forward_step"] == 0 and rows[1]["forward_step"] == 2
    assert headroom_bits(math.inf, "fp16") == -math.inf
    assert headroom_bits(0.0, "fp16") is None
    assert headroom_bits(FP16_MAX, "fp16") == pytest.approx(0.0)


def _kendall_tau(values):
    pairs = concordant = 0
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            pairs += 1
            concordant += (values[j] > values[i]) - (values[j] < values[i])
    return concordant / pairs if pairs else 0.0


def _predict_in_python(values, limit, *, layer, direction, fmt, start=1):
    """predict() as it was before its pairwise slopes were computed in batches: pure Python, one
    series at a time (the reference the batched fits must equal, figure for figure)."""
    points = [(t, v) for t, v in enumerate(values) if t >= start and math.isfinite(v) and v > 0]
    if len(points) < 4:
        return None
    ts = [float(t) for t, _ in points]
    logs = [math.log2(v) for _, v in points]
    target = math.log2(limit)
    last_t, last_log = ts[-1], logs[-1]
    best = None
    for shape in ("exponential", "power", "linear"):
        if shape == "exponential":
            slope, icpt = theil_sen(ts, logs)
            fitted = [icpt + slope * t for t in ts]
            growth = slope
            step = last_t + (target - fitted[-1]) / slope if slope > 0 else None
        elif shape == "power":
            lts = [math.log2(t + 1) for t in ts]
            slope, icpt = theil_sen(lts, logs)
            fitted = [icpt + slope * lt for lt in lts]
            growth = slope * (math.log2(last_t + 2) - math.log2(last_t + 1))
            exponent = (target - icpt) / slope if slope > 0 else math.inf
            step = 2**exponent - 1 if exponent < 60 else None
        else:
            vals = [2**y for y in logs]
            slope, icpt = theil_sen(ts, vals)
            fitted = [math.log2(max(icpt + slope * t, 1e-300)) for t in ts]
            end = icpt + slope * last_t
            growth = math.log2((end + slope) / end) if slope > 0 and end > 0 else 0.0
            step = (limit - icpt) / slope if slope > 0 else None
        residual = statistics.median(abs(y - f) for y, f in zip(logs, fitted, strict=True))
        crossing = None if step is None or step > 1e9 else max(int(last_t), math.ceil(step))
        if best is None or residual < best[0]:
            best = (residual, shape, trend._r2(logs, fitted), crossing, growth, fitted[-1] - fitted[0])
    _, shape, r2, crossing, growth, gained = best
    if last_log >= target:
        crossing = int(last_t)
    return trend.Prediction(
        layer=layer, direction=direction, fmt=fmt, limit=limit, shape=shape, step=crossing,
        growth_bits=growth, gained_bits=gained, headroom_bits=target - last_log, points=len(points),
        tau=_kendall_tau(logs), r2=r2, horizon=int(HORIZON * (last_t + 1)),
    )  # fmt: skip


def _outlook_in_python(series, fmt, train_steps, start=1):
    """outlook() as it was: every series fitted, one at a time, in pure Python."""
    limit = FORMATS[fmt].max_finite
    supported, beyond, watched = [], [], 0
    for s in series:
        for direction, values, bound in (
            ("forward", s.forward, limit),
            ("backward", s.backward, limit),
            ("underflow", s.underflow, UNDERFLOW_LIMIT),
        ):
            p = _predict_in_python(values, bound, layer=s.name, direction=direction, fmt=fmt, start=start)
            if p is None:
                continue
            watched += 1
            if p.step is None or p.step > train_steps or not p.trending:
                continue
            (supported if p.within_evidence else beyond if p.headroom_bits <= UNSURE_MAX_BITS else []).append(
                p
            )
    key = lambda p: (p.step, -p.layer.count("."))  # noqa: E731
    return Outlook(min(supported, key=key, default=None), min(beyond, key=key, default=None), watched)


def _random_series(rng, n):
    growth, noise = rng.choice([0.0, 0.02, 0.3, 2.0]), rng.choice([0.0, 0.05, 0.5])

    def walk(level):
        return [
            level * 2 ** (growth * t + rng.gauss(0, noise)) if rng.random() > 0.05 else float("nan")
            for t in range(n)
        ]

    return walk


def test_the_batched_fits_give_every_figure_the_python_fits_gave():
    """The fits' pairwise slopes are computed in batches (series with the same steps at once: a
    monitor's sampled step on a small model was mostly these fits); every prediction and every
    outlook must be what the pure-Python fits gave, to the last bit."""
    rng = random.Random(0)
    at_risk = 0
    for case in range(300):
        n = rng.randint(2, 34)
        walk = _random_series(rng, n)
        series = [
            LayerSeries(
                f"l{i}",
                "Linear",
                walk(rng.choice([1.0, 1e3])),
                walk(1e-2),
                [min(0.3, v * 1e-3) for v in walk(1.0)],
            )
            for i in range(3)
        ]
        fmt, steps = rng.choice(["fp16", "bf16"]), rng.choice([100, 10_000])
        for s in series:
            for values in (s.forward, s.backward, s.underflow):
                for start in (0, 1):
                    kw = {"layer": s.name, "direction": "forward", "fmt": fmt, "start": start}
                    assert predict(values, FP16_MAX, **kw) == _predict_in_python(values, FP16_MAX, **kw), case
        got = outlook(series, fmt, steps)
        assert got == _outlook_in_python(series, fmt, steps), case
        at_risk += got.at_risk is not None
    assert at_risk > 20  # (the cases include trends at risk, not only noise)


def test_the_monitors_risk_counts_steps_of_the_run_it_watches_without_checks_setting():
    """The monitor (``mixprec train --steps``, ``Monitor(train_steps=)``) names its run's steps as
    they are: no "(--train-steps)", a flag ``train`` does not have; step numbers in the run's own."""
    from mixprec.monitor.judge import range_risk

    window = [LayerSeries("head", forward=[1000.0 + 450.0 * t for t in range(12)])]
    risk = range_risk(window, first_step=100, interval=10, fmt="fp16", train_steps=5000)
    assert risk is not None
    assert "--train-steps" not in risk.message and " of 5000 (" in risk.message, risk.message
    assert f"at about step {risk.step} of 5000" in risk.message
