"""The detector interface: a new kind of trouble is one Detector subclass. A toy detector, added
to the composition, sees every step and every sampled step, reports through the Monitor (which
drops what is no news and decides whether its action runs), is told when a detector before it
explained the step, and keeps its state across a resume."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

import mixprec.monitor.core as core
from mixprec.monitor import Monitor, MonitorFinding
from mixprec.monitor.detectors import Detector, Run, SampleView, StepView, detectors_for


class LossAbove(Detector):
    """Reports each step whose loss is above 1 (with an action), and counts the samples."""

    kinds = ("loss_above",)

    def __init__(self, config):
        super().__init__(config)
        self.seen: list[tuple[int, bool]] = []
        self.samples: list[tuple[int, list[float]]] = []
        self.acted = 0

    def on_step(self, run: Run, view: StepView) -> bool:
        self.seen.append((view.step, view.explained))
        if view.loss is not None and view.loss > 1 and not view.explained:
            run.report(MonitorFinding(view.step, "loss_above", f"loss {view.loss}"), self._act)
        return False

    def _act(self) -> str:
        self.acted += 1
        return "acted"

    def on_sample(self, run: Run, view: SampleView) -> bool:
        self.samples.append((view.step, list(view.losses)))
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"loss_above_acted": self.acted}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.acted = state.get("loss_above_acted", 0)


class ExplainsStep3(Detector):
    def on_step(self, run: Run, view: StepView) -> bool:
        return view.step == 3


@pytest.fixture
def toy(monkeypatch):
    """The default detectors, then one that explains step 3, then the toy."""
    made: list[LossAbove] = []

    def compose(config):
        made.append(LossAbove(config))
        return [*detectors_for(config), ExplainsStep3(config), made[-1]]

    monkeypatch.setattr(core, "detectors_for", compose)
    return made


def run_losses(monitor: Monitor, losses: list[float]) -> None:
    for value in losses:
        monitor.observe(torch.tensor(value))


def test_a_toy_detector_sees_every_step_and_sample_and_reports_through_the_monitor(toy):
    monitor = Monitor(nn.Linear(2, 2), every=4, hold=3, rescue=True)
    run_losses(monitor, [0.5, 2.0, 2.0, 2.0, 0.5, 2.0, 0.5, 0.5, 0.5])
    detector = toy[-1]
    assert detector.seen == [(i, i == 3) for i in range(9)]  # step 3 arrived explained
    assert detector.samples == [(0, [0.5]), (4, [2.0, 2.0, 2.0, 0.5]), (8, [2.0, 0.5, 0.5, 0.5])]
    # step 1 reported and acted on; 2 no news within hold=3; 3 explained; 5 news again, but the
    # action waits hold steps after the last one (step 1): 5 - 1 >= 3, so it runs
    assert [(f.step, f.kind) for f in monitor.findings] == [
        (1, "loss_above"),
        (1, "rescue"),
        (5, "loss_above"),
        (5, "rescue"),
    ]
    assert detector.acted == 2 and monitor.rescues == 2
    monitor.close()


def test_a_detectors_state_joins_the_monitors_and_comes_back(toy):
    first = Monitor(nn.Linear(2, 2), every=4, rescue=True)
    run_losses(first, [2.0])
    state = first.state_dict()
    first.close()
    assert state["loss_above_acted"] == 1
    resumed = Monitor(nn.Linear(2, 2), every=4, rescue=True)
    resumed.load_state_dict(state)
    assert toy[-1].acted == 1 and resumed.step == 1
    resumed.close()
