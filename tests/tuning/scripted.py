"""A framework whose candidates take planted step times (with seeded jitter) and train exactly like
strict fp32: tune's search, race and decision on known answers, with no clock and no noise but the
planted one.

The clock is planted too (:class:`PlantedClock`, put in ``mixprec.clock.now`` by the
``planted_clock`` fixture): it moves only by the planted work done (each step's planted seconds,
each checked step), so a budget pays for that and nothing else, and a tune decides the same on a
machine busy with other tests as on a quiet one (a 30 s budget, paid in wall time, once left a
loaded run no time to check what it measured: fp32 picked where bf16-mixed was planted 2x faster)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch

from mixprec.frameworks import Framework, register_framework, unregister_framework
from mixprec.frameworks.session import BenchSettings, Measurement
from mixprec.hardware.device import DeviceInfo
from mixprec.numerics.compare import Trajectory
from mixprec.numerics.ranges import LayerRanges, RangeReport
from mixprec.policy import Candidate, Support


class PlantedClock:
    """A clock that reads the planted work done so far."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def now(self) -> float:
        return self.seconds

    def spend(self, seconds: float) -> None:
        self.seconds += seconds


CLOCK = PlantedClock()


@pytest.fixture
def planted_clock(monkeypatch: pytest.MonkeyPatch) -> PlantedClock:
    """``mixprec.clock`` reads the planted work (import this fixture into a test module to use it)."""
    monkeypatch.setattr("mixprec.clock.now", CLOCK.now)
    return CLOCK


@dataclass
class Planted:
    """Step seconds per candidate label (e.g. {"fp32": 0.10, "bf16-mixed": 0.05}); unlisted
    candidates are unsupported. ``jitter``: the relative noise of each step (lognormal)."""

    seconds: dict[str, float]
    jitter: float = 0.02
    compile_s: float = 0.0  # what a compiled candidate's first step costs on top
    emulated: frozenset[str] = frozenset()  # policies the device only emulates (supported, not native)
    # a candidate's step (by its index in the session) that stalls, 50x its planted time, once
    stalls: dict[str, int] = field(default_factory=dict)
    # the relative spread of a session's own pace (lognormal, drawn as it opens): a fresh process on
    # the AMX Xeon VM keeps a pace of its own, ~6% off the machine's (issue 53)
    session_sd: float = 0.0
    name: str = "planted"
    description: str = "planted step times"
    default_batch_size: int = 8
    spec: Any = None
    rng: random.Random = field(default_factory=lambda: random.Random(0))


class PlantedSession:
    def __init__(self, workload: Planted, candidate: Candidate, settings: BenchSettings) -> None:
        self.workload, self.candidate, self.settings = workload, candidate, settings
        self.result, self.index = Measurement(observed_dtype="float32"), 0
        # (no draw without a session effect: the other tests' seeded rounds stay as they were)
        self.pace = math.exp(workload.rng.gauss(0, workload.session_sd)) if workload.session_sd else 1.0

    def step(self, timed: bool) -> dict[str, Any]:
        w = self.workload
        seconds = w.seconds[self.candidate.label] * self.pace * math.exp(w.rng.gauss(0, w.jitter))
        if self.index == 0 and self.candidate.compile:
            seconds += w.compile_s
        if w.stalls.get(self.candidate.label) == self.index:
            seconds *= 50
            del w.stalls[self.candidate.label]
        CLOCK.spend(seconds)
        (self.result.step_times_s if timed else self.result.warmup_times_s).append(seconds)
        self.result.first_loss = 1.0
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


class PlantedFramework(Framework):
    name: ClassVar[str] = "planted"
    title: ClassVar[str] = "planted"
    workload_type: ClassVar[type] = Planted
    workload_name: ClassVar[str] = "Planted"
    compile_modes: ClassVar[tuple[str, ...]] = ("default",)
    layouts: ClassVar[bool] = True

    def support(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> Support:
        # the workload's own labels where given (bench asks with it, without tune_candidates first)
        labels = workload.seconds if isinstance(workload, Planted) else self._labels
        emulated = workload.emulated if isinstance(workload, Planted) else self._emulated
        planted = any(label.split("+")[0] == candidate.policy for label in labels)
        if candidate.policy in emulated:
            return Support(True, "emulated here", "fp32", native=False)
        return Support(planted, "planted" if planted else "not planted", None if planted else "fp32")

    _labels: ClassVar[set[str]] = set()
    _emulated: ClassVar[frozenset[str]] = frozenset()

    def tune_candidates(self, workload: Planted, info: DeviceInfo) -> list[Candidate]:
        type(self)._labels, type(self)._emulated = set(workload.seconds), workload.emulated
        return [Candidate(label, framework=self.name) for label in workload.seconds if "+" not in label]

    def make_batches(self, workload, batch_size, device, seed, n):
        return [None] * n

    def peaks(self, info: DeviceInfo, keys: Any) -> dict[str, tuple[float | None, str]]:
        """Planted MFU denominators: no matmul timed on the machine (the inherited peaks measured this
        CPU's whenever a test's cache folder was new, 2-14 s a tune beside another test)."""
        return {key: (1e12, "planted") for key in keys}

    def session(self, workload, candidate, settings, batches):
        return PlantedSession(workload, candidate, settings)

    def trajectory(self, workload, candidate, batches, steps, device, *, perturb=0.0) -> Trajectory:
        """Every candidate trains exactly like strict fp32 but for a rounding far below any limit."""
        CLOCK.spend(steps * workload.seconds.get(candidate.label, workload.seconds["fp32"]))
        traj = Trajectory(candidate.label, losses=[1.0 - 0.01 * i for i in range(steps)])
        traj.stepped, traj.scales = [True] * steps, [None] * steps
        noise = 1e-6 if candidate.policy != "fp32" or perturb else 0.0
        traj.first_output = torch.linspace(1, 2, 8) * (1 + noise)
        traj.first_grads = {"w": torch.linspace(1, 2, 8) * (1 + noise)}
        return traj

    def layer_ranges(self, workload, candidate, batch, device, loss_scale) -> RangeReport:
        CLOCK.spend(workload.seconds.get(candidate.label, workload.seconds["fp32"]))
        layer = LayerRanges("w", "Planted", 0)
        layer.forward.update(torch.linspace(1, 2, 8))
        return RangeReport([layer])


@pytest.fixture
def planted_framework() -> Iterator[PlantedFramework]:
    """The planted backend, registered for the test (import this fixture into a test module to use it)."""
    fw = PlantedFramework()
    register_framework(fw)
    yield fw
    unregister_framework("planted")
