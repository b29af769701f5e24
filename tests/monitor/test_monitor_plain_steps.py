"""A normal step costs the monitor what it must and no more (issue 37's overhead goal): between its
sampled, timed and fed steps, ``observe()`` keeps the loss and counts the step (its plain path),
and no optimizer hook runs. What it records must not change: the plain path is compared with the
whole path on runs that skip, spike, stall and rescue."""

from __future__ import annotations

import pytest
import torch
from monitor_faults import mlp, regression

import mixprec
from mixprec.monitor import Monitor
from mixprec.monitor.faults import FaultInjector

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def run(workload, policy_name, steps, *, faults=None, every=20, **monitor_kw):
    """A plain loop that hands its loss over before the update, as ``mixprec train`` does; returns
    the monitor (closed) and the steps the monitor's optimizer post-step hook ran at."""
    policy = mixprec.get_policy(policy_name, device="cpu")
    model = policy.prepare(workload.model)
    optimizer = workload.make_optimizer(model)
    injector = faults(model, optimizer) if faults is not None else None
    monitor = Monitor(model, policy, optimizer=optimizer, loss_fn=workload.loss_fn, every=every, **monitor_kw)
    hooked: list[int] = []  # the steps whose update the monitor's post-step hooks were armed for
    whole: list[int] = []
    sampler_next = monitor.sampler.next

    def counted_next(step):  # (called once by each observe() that runs whole)
        whole.append(step - 1)
        sampler_next(step)

    monitor.sampler.next = counted_next
    torch.manual_seed(0)
    for step in range(steps):
        if injector is not None:
            injector.step = step  # (the loop's step: a skipped one is counted too)
        batch = workload.make_batch(32, CPU)
        with policy.autocast():
            loss = workload.loss_fn(model, batch)
        optimizer.zero_grad()
        policy.backward(loss)
        monitor.before_step(loss, batch, batch_index=step)
        if monitor._after:
            hooked.append(step)
        policy.step(optimizer)
        monitor.observe(loss, batch)
    monitor.close()
    if injector is not None:
        injector.close()
    return monitor, hooked, whole


def record(monitor):
    """What a run's monitor recorded (everything but the times it took)."""
    series = {
        name: (s.forward, s.backward, s.underflow) for name, s in monitor.sampler.recorder.series.items()
    }
    return {
        "step": monitor.step,
        "losses": monitor.losses,
        "skipped": monitor.skipped,
        "scales": monitor.scales,
        "samples": monitor.sampler.steps,
        "stalls": monitor.sampler.stalls,
        "series": series,
        "findings": [(f.step, f.kind, f.module, f.action) for f in monitor.findings],
        "withheld": monitor.withheld,
        "skipped_batches": monitor.skipped_batches,
    }


def whole_path_only(monkeypatch):
    """The monitor without its plain path: every step's observe() runs whole."""
    monkeypatch.setattr(Monitor, "_next_busy_step", lambda self: self.step)


def inf_gradients(at):
    return lambda model, optimizer: FaultInjector(model, fault="inf", where="gradient", steps=at)


CASES = {
    # fp16-mixed: GradScaler's skips (its start-up, and an inf gradient at steps 130 and 131) and
    # the scale it settles at
    "fp16 skips": (mlp, "fp16-mixed", 240, inf_gradients({130, 131}), {}),
    # bf16-true: half weights, so the sampled steps count stalls at their update
    "bf16-true stalls": (mlp, "bf16-true", 240, None, {}),
    # a data spike at step 150, diagnosed before its update and withheld
    "data spike rescued": (lambda: regression(150), "bf16-mixed", 240, None, {"rescue": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_plain_path_records_what_the_whole_path_records(case, monkeypatch):
    build, policy, steps, faults, kw = CASES[case]
    plain, _, plain_whole = run(build(), policy, steps, faults=faults, **kw)
    with monkeypatch.context() as m:
        whole_path_only(m)
        whole, _, whole_whole = run(build(), policy, steps, faults=faults, **kw)
    assert record(plain) == record(whole)
    assert plain.step == steps and plain.sampler.steps  # (the runs were sampled, and ran to the end)
    assert len(whole_whole) == steps
    assert len(plain_whole) < steps / 2  # the plain path was taken


def test_a_normal_step_runs_no_optimizer_hook():
    """bf16-mixed (fp32 weights: no stall to count): once the loop is confirmed (its first step),
    no monitor hook runs at any update; the old monitor ran its post-step hook at every one."""
    monitor, hooked, _ = run(mlp(), "bf16-mixed", 200)
    assert hooked == [0]  # the first update confirms the loop steps the policy
    assert not monitor._after and not monitor._armed


def test_half_weights_hook_only_the_updates_of_sampled_steps():
    """bf16-true: a sampled step's stalls are counted at its update, so the post-step hook runs at
    the sampled steps (and the first, which confirms the loop), not between them."""
    monitor, hooked, _ = run(mlp(), "bf16-true", 200)
    assert hooked == sorted({0, *monitor.sampler.steps})
    assert len(monitor.sampler.stalls) == len(monitor.sampler.steps)


def test_a_spike_after_a_long_plain_stretch_is_still_caught_before_its_update():
    """Sampled rarely (every 400 steps), the spike at step 150 falls in the plain stretch: its
    quick test still stages it and the update is withheld."""
    monitor, _, _ = run(regression(150), "bf16-mixed", 240, every=400, rescue=True)
    assert monitor.withheld == [150]
    assert any(f.step == 150 and f.evidence.get("verdict") == "data" for f in monitor.findings)


def test_a_loss_left_on_the_device_keeps_its_place_among_the_ones_read_before_their_update():
    """A GPU loop whose ``observe()`` is sometimes given another tensor than ``before_step`` was (a
    mean built twice): that step's loss waits on the device for the next sampled step, while the
    next steps' were read before their update. The plain path appended those ahead of it, so the
    detectors' ranges put values on the wrong steps (a review of the third H200 lease's change, which
    gave a GPU loss the plain path). ``_host = False`` is the monitor's state for a GPU loss."""
    w = regression()
    policy = mixprec.get_policy("bf16-mixed", device="cpu")
    model = policy.prepare(w.model)
    optimizer = w.make_optimizer(model)
    monitor = Monitor(model, policy, optimizer=optimizer, loss_fn=w.loss_fn, every=1000)
    monitor._host = False  # (as a CUDA loss: not read by observe(), kept for the next sample)
    torch.manual_seed(0)
    seen = []
    for step in range(60):
        batch = w.make_batch(32, CPU)
        with policy.autocast():
            loss = w.loss_fn(model, batch)
        optimizer.zero_grad()
        policy.backward(loss)
        monitor.before_step(loss, batch, batch_index=step)
        policy.step(optimizer)
        monitor.observe(loss.detach() if step % 7 == 3 else loss, batch)
        seen.append(loss.item())
    assert monitor.read_losses() == seen
    monitor.close()
