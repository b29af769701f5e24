"""The trend behind `at-risk`: fits that find the crossing step, refuse to extrapolate past their
evidence, and stay quiet on the noise of a healthy run."""

from __future__ import annotations

import math
import random

import pytest

from mixprec.numerics.limits import FORMATS
from mixprec.numerics.trend import (
    HORIZON,
    UNDERFLOW_LIMIT,
    LayerSeries,
    headroom_bits,
    least_headroom,
    outlook,
    predict,
)

FP16_MAX = FORMATS["fp16"].max_finite


def test_linear_growth_is_predicted_to_cross_where_it_will():
    values = [1000.0 + 450.0 * t for t in range(12)]  # crosses 65504 at t = 143.3
    p = predict(values, FP16_MAX, layer="head", direction="forward", fmt="fp16")
    assert p is not None and p.trending and p.within_evidence
    assert p.shape == "linear"
    assert 140 <= p.step <= 148, p.step
    assert "layer 'head': its outputs, predicted to overflow fp16" in p.describe(10_000)
    assert f"at about step {p.step} of 10000" in p.describe(10_000)


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
