"""A low format rides on its carrier: where the carrier measures slower than strict fp32, its low
formats wait until the rest of the sweep is measured. On planted step times (tests/tuning/scripted.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import mixprec
from mixprec.policy import Candidate

from .scripted import Planted, PlantedFramework, planted_clock, planted_framework  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("planted_clock", "planted_framework")


def measured_order(seconds: dict[str, float]) -> list[str]:
    order: list[str] = []

    def events(event):
        if event.get("event") == "candidate":
            order.append(event["label"])

    PlantedFramework._labels = set(seconds)  # (what tune_candidates sets: the planted policies)
    plan = [Candidate(label, framework="planted") for label in seconds]
    mixprec.bench(
        Planted(seconds, jitter=0.0), candidates=plan, steps=4, warmup=1, device="cpu", events=events
    )
    return [label for label in order if label != "fp32" and not label.endswith("(retry)")]


def test_a_carrier_slower_than_strict_fp32_sends_its_low_formats_to_the_end():
    """The H200's tune of a small nanoGPT-style script (2026-11-30): bf16-mixed 0.80x, then its fp8
    formats (0.30x, 0.33x) measured before tf32 and fp16-mixed, which the 120 s budget never reached."""
    slow = {"fp32": 1.0, "bf16-mixed": 1.25, "fp8-rowwise": 3.0, "fp8-tensorwise": 3.0, "fp16-mixed": 0.8}
    assert measured_order(slow) == ["bf16-mixed", "fp16-mixed", "fp8-rowwise", "fp8-tensorwise"]
    # a carrier that is faster keeps them right behind it (where fp8 may pay: a wide model)
    fast = {**slow, "bf16-mixed": 0.5}
    assert measured_order(fast) == ["bf16-mixed", "fp8-rowwise", "fp8-tensorwise", "fp16-mixed"]


@pytest.mark.parametrize(
    ("status", "ratios"), [("ok", (0.8, 0.78, 0.82, 0.8)), ("pruned", ())], ids=["slower", "pruned"]
)
def test_a_low_format_with_a_precision_map_waits_behind_a_slow_carrier_too(status, ratios):
    """A low format with ``keep_bf16`` (tune's precision-map fix) rides on the same carrier; the
    order test rebuilt it as its carrier, which a carrier refuses (the review of this change: the
    whole sweep stopped on a PolicyError). A carrier pruned as far slower sends its riders last too."""
    from mixprec.measure.results import BenchRow
    from mixprec.measure.sweep import riding_last

    carrier = Candidate("bf16-mixed")
    row = BenchRow("w", carrier, "cpu", 8, status, paired_ratios=ratios)
    mapped = Candidate("fp8-rowwise", keep_bf16=("head",))
    rest = [(2, mapped), (3, Candidate("fp8-rowwise", channels_last=True)), (4, Candidate("fp16-mixed"))]
    moved = riding_last(carrier, row, rest)
    assert [i for i, _ in moved] == [3, 4, 2]  # (fp8 with channels_last rides on bf16-mixed+cl)


def test_a_carrier_no_faster_than_strict_fp32_with_an_interval_reaching_1x_still_sends_them_last():
    """The fifth H200 lease (2026-11-30): bf16-mixed 0.96x [0.88-1.02] on the same script kept its
    fp8 formats right behind it (the old rule waited for the interval to end below 1x), and eager
    fp8 runs at 0.75x its carrier: 0.31x and 0.32x measured where fp16-mixed and tf32 never were."""
    from mixprec.measure.results import BenchRow
    from mixprec.measure.sweep import riding_last

    carrier = Candidate("bf16-mixed")
    rest = [(2, Candidate("fp8-rowwise")), (3, Candidate("fp16-mixed"))]
    no_faster = BenchRow("w", carrier, "cpu", 8, "ok", paired_ratios=(0.96, 0.88, 1.02, 0.97))
    assert [i for i, _ in riding_last(carrier, no_faster, rest)] == [3, 2]
    faster = BenchRow("w", carrier, "cpu", 8, "ok", paired_ratios=(1.04, 0.98, 1.12, 1.03))
    assert [i for i, _ in riding_last(carrier, faster, rest)] == [2, 3]


def test_the_late_part_of_a_cut_sweep_measures_a_slow_carriers_low_formats_last(monkeypatch):
    """A sweep cut by its share of the budget right after a carrier that ran slower than strict
    fp32: the late part (the time the checks left) measured that carrier's fp8 formats first, in
    the plan's order, though the first part had already moved them to its end."""
    import mixprec.tuning.order as order_module
    import mixprec.tuning.search as search_module

    # the plan's order fixed (it follows this CPU's measured bf16 and fp16 rates otherwise)
    monkeypatch.setattr(
        order_module, "measured_gain", lambda info, conv: lambda c: {"bf16": 2.0}.get(c.spec.peak_key, 1.5)
    )
    real_sweep = search_module.run_sweep
    sweeps: list[list[str]] = []

    def cut_after_the_carrier(workload, framework, config, **kwargs):
        sweeps.append([])
        started, forward = sweeps[-1], kwargs["events"]

        def events(event):
            if event["event"] == "candidate":
                started.append(event["label"])
            forward(event)

        if len(sweeps) == 1:  # stopped as it starts the candidate after bf16-mixed
            stop = lambda: "bf16-mixed" in started[:-1]  # noqa: E731
            kwargs = {**kwargs, "budget": replace(kwargs["budget"], stop=stop)}
        return real_sweep(workload, framework, config, **{**kwargs, "events": events})

    monkeypatch.setattr(search_module, "run_sweep", cut_after_the_carrier)
    seconds = {"fp32": 1.0, "bf16-mixed": 1.25, "fp8-rowwise": 3.0, "fp8-tensorwise": 3.0, "fp16-mixed": 0.8}
    mixprec.tune(
        Planted(seconds), budget_s=3600, steps=4, warmup=1, check_steps=2, compile_modes=(), optimizers=False
    )
    first, late = sweeps[0], [label for label in sweeps[1] if label != "fp32"]
    assert first[:3] == ["fp32", "bf16-mixed", "fp16-mixed"], first  # fp8 already moved behind fp16-mixed
    assert late == ["fp16-mixed", "fp8-rowwise", "fp8-tensorwise"], late
