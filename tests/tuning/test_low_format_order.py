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
