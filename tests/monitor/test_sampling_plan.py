"""The sampling plan: a run whose length is known gets enough samples for its trend rules, however
much sampling costs (a 300-step `mixprec train` was sampled once, at step 0, every 400 steps)."""

from __future__ import annotations

from torch import nn

from mixprec.monitor.sampler import EVERY, MIN_SAMPLES, Sampler


def _costly(sampler: Sampler, steps: int) -> None:
    """Steps of 10 ms, each sampled one 10 s: far over the sampling budget at any interval."""
    for step in range(steps):
        sampler.tick(step, 10.0 if sampler.due(step) else 0.01)


def test_a_300_step_run_is_sampled_often_enough_for_its_trends():
    sampler = Sampler(nn.Linear(4, 4), None, None, run_steps=300)
    assert sampler.interval == 300 // MIN_SAMPLES
    _costly(sampler, 300)
    assert sampler.interval <= 300 // MIN_SAMPLES
    assert len(range(0, 300, sampler.interval)) >= MIN_SAMPLES


def test_a_long_run_still_widens_to_its_budget_and_a_fixed_interval_is_kept():
    sampler = Sampler(nn.Linear(4, 4), None, None, run_steps=1_000_000)
    assert sampler.interval == EVERY
    _costly(sampler, 20_000)
    assert sampler.interval > EVERY and sampler.interval % EVERY == 0
    fixed = Sampler(nn.Linear(4, 4), None, 7, run_steps=300)
    _costly(fixed, 300)
    assert fixed.interval == 7
