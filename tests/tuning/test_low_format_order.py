"""A low format rides on its carrier: where the carrier measures slower than strict fp32, its low
formats wait until the rest of the sweep is measured. On planted step times (tests/tuning/scripted.py)."""

from __future__ import annotations

import pytest

import mixprec
from mixprec.frameworks import register_framework, unregister_framework
from mixprec.policy import Candidate

from .scripted import Planted, PlantedFramework, planted_clock  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("planted_clock")


@pytest.fixture
def framework():
    fw = PlantedFramework()
    register_framework(fw)
    yield fw
    unregister_framework("planted")


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


def test_a_carrier_slower_than_strict_fp32_sends_its_low_formats_to_the_end(framework):
    """The H200's tune of a small nanoGPT-style script (2026-11-30): bf16-mixed 0.80x, then its fp8
    formats (0.30x, 0.33x) measured before tf32 and fp16-mixed, which the 120 s budget never reached."""
    slow = {"fp32": 1.0, "bf16-mixed": 1.25, "fp8-rowwise": 3.0, "fp8-tensorwise": 3.0, "fp16-mixed": 0.8}
    assert measured_order(slow) == ["bf16-mixed", "fp16-mixed", "fp8-rowwise", "fp8-tensorwise"]
    # a carrier that is faster keeps them right behind it (where fp8 may pay: a wide model)
    fast = {**slow, "bf16-mixed": 0.5}
    assert measured_order(fast) == ["bf16-mixed", "fp8-rowwise", "fp8-tensorwise", "fp16-mixed"]
