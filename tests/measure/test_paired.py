"""The paired sweep on scripted sessions: the pairing, the ratios and the pruning are arithmetic on
the step times a session reports, so a session that reports chosen times tests them exactly (no
clock, no noise)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from mixprec.frameworks import Framework
from mixprec.frameworks.session import BenchSettings, Measurement
from mixprec.hardware.device import DeviceInfo
from mixprec.measure.paired import PairedSweep
from mixprec.policy import Candidate, Support

ORDER: list[str] = []  # which session stepped, in order


@dataclass
class Scripted:
    """A workload whose candidates take fixed seconds per step (policy -> seconds)."""

    seconds: dict[str, float]
    first_step: dict[str, float] = field(default_factory=dict)  # a cold first step, if different
    name: str = "scripted"
    description: str = ""
    default_batch_size: int = 8
    spec: Any = None


class ScriptedSession:
    def __init__(self, workload: Scripted, candidate: Candidate, settings: BenchSettings) -> None:
        self.workload, self.candidate, self.settings = workload, candidate, settings
        self.result, self.index = Measurement(), 0

    def step(self, timed: bool) -> dict[str, Any]:
        policy = self.candidate.policy
        seconds = self.workload.seconds[policy]
        if self.index == 0:
            seconds = self.workload.first_step.get(policy, seconds)
        ORDER.append(policy)
        (self.result.step_times_s if timed else self.result.warmup_times_s).append(seconds)
        self.index += 1
        return {"event": "step", "index": self.index - 1, "seconds": seconds, "timed": timed, "loss": 1.0}

    def warm_enough(self, times: list[float]) -> bool:
        return len(times) >= self.settings.warmup

    def warm_up(self, emit: Any) -> bool:
        while not self.warm_enough(self.result.warmup_times_s):
            emit(self.step(timed=False))
        return True

    def finish(self) -> Measurement:
        return self.result


class ScriptedFramework(Framework):
    name: ClassVar[str] = "scripted"
    title: ClassVar[str] = "scripted"
    workload_type: ClassVar[type] = Scripted
    workload_name: ClassVar[str] = "Scripted"

    def support(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> Support:
        return Support(True, "scripted")

    def session(self, workload, candidate, settings, batches):
        return ScriptedSession(workload, candidate, settings)


def sweep(workload: Scripted, steps: int = 4, prune_factor: float = 5.0) -> PairedSweep:
    ORDER.clear()
    settings = BenchSettings(device="cpu", batch_size=8, steps=steps, warmup=1)
    return PairedSweep(
        ScriptedFramework(),
        workload,
        settings,
        label="scripted",
        isolate=False,
        prune_factor=prune_factor,
        events=lambda event: None,
        should_stop=lambda: False,
    )


def cand(policy: str) -> Candidate:
    return Candidate(policy, framework="scripted")


def test_rounds_alternate_abba_and_the_ratio_is_the_baselines_time_over_the_candidates():
    paired = sweep(Scripted({"fp32": 0.3, "bf16-mixed": 0.2}))
    paired.start_baseline(count_flops=False)
    ORDER.clear()
    row = paired.measure(cand("bf16-mixed"))
    timed = [p for p in ORDER if p]  # warm-up first, then the rounds
    rounds = timed[1:]  # the candidate's one warm-up step
    # one step per side and round (0.2-0.3 s steps fill a 0.2 s round): ABBA ...
    assert rounds == ["fp32", "bf16-mixed", "bf16-mixed", "fp32", "fp32", "bf16-mixed", "bf16-mixed", "fp32"]
    assert row.paired_ratios == pytest.approx((1.5, 1.5, 1.5, 1.5))
    assert row.status == "ok" and row.step_times_ms == pytest.approx((200.0,) * 4)


def test_a_candidate_far_slower_than_the_best_is_pruned_with_the_figure_it_reached():
    """Steps under the one-second floor of a step limit: two paired rounds at 1/10 of the best
    prune it, and the row keeps the figure it reached."""
    paired = sweep(Scripted({"fp32": 0.05, "fp16-mixed": 0.5}), prune_factor=5.0)
    paired.start_baseline(count_flops=False)
    row = paired.measure(cand("fp16-mixed"))
    assert row.status == "pruned" and "two paired rounds at least 5x slower" in row.reason
    assert row.paired_ratios == pytest.approx((0.1, 0.1)) and row.step_times_ms


def test_a_step_over_its_limit_prunes_at_once():
    paired = sweep(Scripted({"fp32": 0.3, "fp16-mixed": 3.0}), prune_factor=5.0)
    paired.start_baseline(count_flops=False)
    row = paired.measure(cand("fp16-mixed"))  # its cold step against fp32's: 3.0 s > 5 x 0.3 s
    assert row.status == "pruned" and "step 0 took 3.0 s (limit 1.5 s)" in row.reason


def test_a_cold_first_step_is_judged_against_the_baselines_cold_first_step():
    """A compile-like first step (30 s against fp32's 10 s cold step) is within 5x of the baseline's
    own first step: not pruned, however slow it is against fp32's warm steps."""
    paired = sweep(Scripted({"fp32": 0.3, "bf16-mixed": 0.25}, first_step={"fp32": 10.0, "bf16-mixed": 30.0}))
    paired.start_baseline(count_flops=False)
    assert paired.measure(cand("bf16-mixed")).status == "ok"
    slower = sweep(Scripted({"fp32": 0.3, "bf16-mixed": 0.25}, first_step={"fp32": 1.0, "bf16-mixed": 30.0}))
    slower.start_baseline(count_flops=False)
    row = slower.measure(cand("bf16-mixed"))
    assert row.status == "pruned" and "step 0 took 30.0 s (limit 5.0 s)" in row.reason


def test_the_baselines_row_covers_every_step_it_timed_during_the_sweep():
    paired = sweep(Scripted({"fp32": 0.3, "bf16-mixed": 0.2}), steps=2)
    first = paired.start_baseline(count_flops=False)
    paired.measure(cand("bf16-mixed"))
    final = paired.finish_baseline()
    assert len(first.step_times_ms) == 2 and len(final.step_times_ms) == 4  # its own 2 + 2 paired rounds
