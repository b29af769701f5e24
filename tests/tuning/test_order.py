"""The sweep measures where the answer is predicted to be first (no timing: planted predictions)."""

from __future__ import annotations

from mixprec.hardware.device import detect
from mixprec.hardware.formats import format_speed
from mixprec.policy import Candidate
from mixprec.tuning.order import measured_gain, sweep_order

PLAN = [
    Candidate(p, cl)
    for p in ("fp32", "bf32", "bf16-mixed", "fp16-mixed", "bf16-true")
    for cl in (False, True)
]


def labels(cands):
    return [c.label for c in cands]


def test_predicted_leaders_before_predicted_losers():
    # a Xeon with AMX-BF16 but only emulated fp16: bf16 leads, fp16 slower than fp32
    gains = {"fp32": 1.0, "bf32": 2.0, "bf16-mixed": 2.0, "bf16-true": 2.0, "fp16-mixed": 0.1}
    order = labels(sweep_order(PLAN, lambda c: gains[c.policy]))
    assert order[0] == "fp32"  # the reference first
    # the formats computing in bf16 lead, each family's layout right after its leader; bf32 (fp32
    # storage, converted per op) after them at the same predicted rate; strict fp32's own layout at
    # fp32's speed after every family predicted faster; the predicted loser last
    assert order[1:] == [
        "bf16-mixed", "bf16-mixed+cl", "bf16-true", "bf16-true+cl", "bf32", "bf32+cl", "fp32+cl",
        "fp16-mixed", "fp16-mixed+cl",
    ]  # fmt: skip


def test_where_bf16_is_slower_it_is_measured_last():
    # a Xeon without AVX512-BF16: bf16 matmuls run at a third of fp32's rate
    gains = {"fp32": 1.0, "bf32": 0.3, "bf16-mixed": 0.3, "bf16-true": 0.3, "fp16-mixed": 0.1}
    order = labels(sweep_order(PLAN, lambda c: gains[c.policy]))
    assert order.index("fp16-mixed") > order.index("bf16-true") > order.index("fp32+cl")
    assert order[:2] == ["fp32", "fp32+cl"]  # where nothing is predicted faster, fp32's layout is next


def test_without_predictions_half_formats_lead_in_registry_order_after_the_scripts_own():
    as_written = Candidate("fp16-mixed", as_written=True)
    order = sweep_order([*PLAN, as_written], lambda c: None)
    assert order[0] == as_written  # what the user runs today
    assert labels(order[1:]) == [
        "fp32", "bf16-mixed", "bf16-mixed+cl", "fp16-mixed", "fp16-mixed+cl",
        "bf16-true", "bf16-true+cl", "fp32+cl", "bf32", "bf32+cl",
    ]  # fmt: skip


def test_the_cpu_prediction_comes_from_the_measured_rates():
    info = detect("cpu")
    gain = measured_gain(info, conv=False)
    assert gain(Candidate("fp32")) == 1.0 and gain(Candidate("fp8-rowwise")) is None
    bf16 = gain(Candidate("bf16-mixed"))
    assert bf16 == format_speed(info, "bf16", conv=False).matmul
    assert gain(Candidate("bf32")) == bf16  # oneDNN's bf16 kernels
    conv = measured_gain(info, conv=True)(Candidate("fp16-mixed"))
    assert conv == format_speed(info, "fp16").conv  # a CNN is ranked by its convolutions' rate


def test_a_low_format_is_measured_right_after_its_carrier_not_by_its_peak():
    """The H200's datasheet ranks fp8 at twice bf16; the tune of 2026-11-27 measured fp8 first and
    never reached bf16-mixed (eager fp8 ran at 0.75x bf16-mixed on a 2048-wide GPT)."""
    gpu = {"fp32": 1.0, "tf32": 7.4, "bf16-mixed": 14.8, "fp16-mixed": 14.8, "fp8-rowwise": 29.5,
           "fp8-tensorwise": 29.5, "mxfp8": 29.5, "nvfp4": 59.0}  # fmt: skip
    plan = [Candidate(p) for p in ("fp32", "fp8-rowwise", "nvfp4", "tf32", "fp16-mixed", "fp8-tensorwise")]
    plan.append(Candidate("bf16-mixed"))
    order = labels(sweep_order(plan, lambda c: gpu[c.policy]))
    assert order[:2] == ["fp32", "bf16-mixed"]
    assert set(order[2:5]) == {"fp8-rowwise", "fp8-tensorwise", "nvfp4"}  # after their carrier
    assert order[5:] == ["fp16-mixed", "tf32"]
    # without bf16-mixed in the plan, a low format still waits for where bf16-mixed would be
    no_carrier = labels(sweep_order([c for c in plan if c.policy != "bf16-mixed"], lambda c: gpu[c.policy]))
    assert no_carrier.index("fp16-mixed") > no_carrier.index("fp8-rowwise")
    assert no_carrier.index("tf32") > no_carrier.index("fp8-rowwise")
