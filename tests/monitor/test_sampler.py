"""The monitor's sampler: which steps are sampled, what a sampled step costs, and how the automatic
interval keeps that cost inside its budget (a scripted clock stands in for the machine's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.monitor import Monitor, sampler
from mixprec.monitor.sampler import BUDGET, EVERY, Sampler


class Clock:
    """perf_counter for the sampler: each step lasts ``step`` seconds, a sampled one ``extra`` more."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(s: Sampler, clock: Clock, steps: int, step_s: float, extra_s: float, model: nn.Module) -> None:
    """``steps`` training steps of ``model`` through ``s``; the clock moves as a real step would."""
    x = torch.randn(4, 8)
    for step in range(s.steps[-1] + 1 if s.steps else 0, steps):
        if step == 0:
            s.begin(0)
        model(x).sum().backward()
        if s.due(step):
            s.end(step, None, skipped=False)
        clock.now += step_s + (extra_s if s.due(step) else 0.0)
        s.next(step + 1)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(sampler.time, "perf_counter", c)
    return c


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_a_cheap_sample_keeps_the_default_interval(clock):
    s = Sampler(model(), "fp16", every=None)
    # a sample costing a tenth of a step: 0.1 / 100 steps, under the budget
    run(s, clock, 1000, step_s=1e-3, extra_s=0.1e-3, model=s.model)
    assert s.interval == EVERY and s.steps == list(range(0, 1000, EVERY))


def test_an_expensive_sample_widens_the_interval_to_the_budget_and_keeps_the_grid(clock):
    s = Sampler(model(), "fp16", every=None)
    # a sample costing 3 steps: at every 100 steps that is 3% of the run
    run(s, clock, 5000, step_s=1e-3, extra_s=3e-3, model=s.model)
    needed = 3e-3 / (BUDGET * 1e-3)
    assert s.interval == EVERY * round(needed / EVERY)  # the smallest multiple within the budget
    assert 3e-3 / (s.interval * 1e-3) <= BUDGET * (1 + 1e-9) < 3e-3 / ((s.interval - EVERY) * 1e-3)
    assert s.steps == list(range(0, 5000, s.interval))  # samples off the new grid dropped: evenly spaced
    for series in s.recorder.series.values():
        assert len(series.forward) == len(series.backward) == len(series.underflow) == len(s.steps)


def test_one_slow_sample_is_not_enough_to_widen(clock):
    s = Sampler(model(), "fp16", every=None)
    x = torch.randn(4, 8)
    s.begin(0)
    for step in range(400):
        s.model(x).sum().backward()
        if s.due(step):
            s.end(step, None, skipped=False)
        # one sample (step 200) is slow, a pause of the machine; the others are cheap
        clock.now += 1e-3 + (50e-3 if step == 200 else 0.0)
        s.next(step + 1)
    assert s.interval == EVERY


def test_an_interval_the_user_gave_is_kept(clock):
    s = Sampler(model(), "fp16", every=10)
    run(s, clock, 500, step_s=1e-3, extra_s=50e-3, model=s.model)
    assert s.interval == 10 and len(s.steps) == 50


def test_the_interval_survives_a_resume(clock):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    first = Monitor(net, optimizer=opt)
    run(first.sampler, clock, 5000, step_s=1e-3, extra_s=3e-3, model=net)
    state = first.state_dict()
    first.close()
    resumed = Monitor(net, optimizer=opt)
    resumed.load_state_dict(state)
    assert resumed.every == first.every > EVERY
    assert resumed.sampler.steps == first.sampler.steps
    resumed.close()
    fixed = Monitor(net, optimizer=opt, every=5)
    fixed.load_state_dict(state)
    assert fixed.every == 5  # the user's interval wins
    fixed.close()
