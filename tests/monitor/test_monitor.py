"""The monitor on injected faults, through a plain loop with a mixprec Policy and through a plain
torch.amp loop: each fault raises the right kind of finding, about the right module, within
``every`` steps of its onset; ``rescue=True`` finishes the run near fp32, ``rescue=False`` alerts
and leaves the run as it was; a bad batch is never blamed on the policy; a poisoned checkpoint is
never written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from monitor_faults import amplified, corrupt_batch, mlp, overflow_from
from torch import nn

import mixprec
from mixprec.errors import UsageError
from mixprec.monitor import Monitor, PoisonedCheckpointError

LATE = str(Path(__file__).parents[2] / "examples" / "late_overflow.py") + ":workload"
FIRST_FP16_OVERFLOW = 139  # benchmarks/results/cpu-amd-epyc/late_overflow.json, plain loop
EVERY = 20


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def train(workload, policy_name, steps, *, fault=None, **monitor_kw):
    """A plain loop under a mixprec Policy with a Monitor; ``fault(step, model, batch)`` may
    change the batch (returned) or the model. Returns (monitor, losses, policy)."""
    policy = mixprec.get_policy(policy_name, device="cpu")
    model = policy.prepare(workload.model)
    optimizer = workload.make_optimizer(model)
    monitor = Monitor(model, policy, optimizer=optimizer, loss_fn=workload.loss_fn, every=EVERY, **monitor_kw)
    torch.manual_seed(0)
    losses = []
    for step in range(steps):
        batch = workload.make_batch(workload.default_batch_size, torch.device("cpu"))
        if fault is not None:
            batch = fault(step, model, batch)
        with policy.autocast():
            loss = workload.loss_fn(model, batch)
        optimizer.zero_grad()
        policy.backward(loss)
        policy.step(optimizer)
        monitor.observe(loss, batch)
        losses.append(float(loss.detach()))
    monitor.close()
    return monitor, losses, policy


def kinds(monitor):
    return [(f.kind, f.module) for f in monitor.findings]


def test_a_late_fp16_overflow_is_seen_before_it_happens_and_rescued_near_fp32():
    _, fp32, _ = train(mixprec.load_workload(LATE), "fp32", 300)
    alert, losses, policy = train(mixprec.load_workload(LATE), "fp16-mixed", 300, rescue=False)
    first = alert.findings[0]
    assert (first.kind, first.module) == ("predicted_overflow", "head"), kinds(alert)
    assert first.step <= FIRST_FP16_OVERFLOW and first.evidence["predicted_step"] <= 2 * FIRST_FP16_OVERFLOW
    assert ("overflow", "head") in kinds(alert)  # and, left alone, it does overflow
    assert not math.isfinite(losses[-1]) and policy.config.keep_fp32 == ()  # the run was not touched
    assert not alert.healthy

    rescued, losses, policy = train(mixprec.load_workload(LATE), "fp16-mixed", 300, rescue=True)
    assert ("rescue", "head") in kinds(rescued) and policy.config.keep_fp32 == ("head",)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-20:]) == pytest.approx(sum(fp32[-20:]), rel=0.01)  # within fp32's noise band
    assert rescued.healthy


def test_a_bad_batch_is_the_data_not_the_precision():
    monitor, losses, policy = train(mlp(), "fp16-mixed", 200, fault=corrupt_batch(150), rescue=True)
    assert kinds(monitor) == [("bad_batch", None)], kinds(monitor)
    assert monitor.findings[0].step == 150 and "not blamed" in monitor.findings[0].message
    assert policy.config.label == "fp16-mixed" and policy.config.keep_fp32 == ()  # nothing rescued
    assert math.isfinite(losses[-1])


def test_a_scale_collapse_is_named_and_left_alone_without_rescue():
    from mixprec.policy.scaler import ScaleCollapseError

    with pytest.raises(ScaleCollapseError):  # the policy's own floor stops the run, as without a monitor
        train(amplified(), "fp16-mixed", 200, fault=overflow_from(100), rescue=False, findings=None)
    # the same run, watched: the findings name the module before the policy gives up
    findings = []
    with pytest.raises(ScaleCollapseError):
        train(amplified(), "fp16-mixed", 200, fault=overflow_from(100), findings=findings.append)
    assert [(f.kind, f.module) for f in findings][:2] == [("overflow", "2"), ("scale_collapse", "2")]
    assert findings[0].step == 101 and findings[1].step <= 100 + EVERY  # its second skip: it persists


def test_a_scale_collapse_is_rescued_by_an_fp32_island():
    _, fp32, _ = train(amplified(), "fp32", 200, fault=overflow_from(100))
    monitor, losses, policy = train(amplified(), "fp16-mixed", 200, fault=overflow_from(100), rescue=True)
    assert kinds(monitor)[:2] == [("overflow", "2"), ("rescue", "2")]
    assert policy.config.keep_fp32 == ("2",)
    assert sum(losses[-20:]) == pytest.approx(sum(fp32[-20:]), rel=0.05)


def test_nan_weights_are_never_checkpointed_and_a_rescue_rolls_them_back(tmp_path):
    def nan_weight(step, model, batch):
        if step == 50:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        return batch

    path = tmp_path / "ckpt.pt"
    monitor, _, _ = train(mlp(), "bf16-mixed", 55, fault=nan_weight)
    with pytest.raises(PoisonedCheckpointError, match=r"step 55: \d.weight holds inf/NaN"):
        monitor.save({"model": monitor.model.state_dict()}, path)
    assert not path.exists()
    assert monitor.findings[-1].kind == "checkpoint_refused" and monitor.findings[-1].module in ("0", "2")

    monitor, losses, _ = train(mlp(), "bf16-mixed", 100, fault=nan_weight, rescue=True, snapshot_every=10)
    assert [k for k, _ in kinds(monitor)] == ["nonfinite_weights", "rescue"]
    # the snapshot of step 50 was not taken: the weights were already poisoned
    assert "rolled back to the snapshot of step 40" in next(
        f.message for f in monitor.findings if f.kind == "rescue"
    )
    monitor.save({"model": monitor.model.state_dict()}, path)  # finite again: written
    assert path.exists() and math.isfinite(losses[-1])


def stalling(lr=1e-3):
    """The MLP with plain SGD at ``lr``: most updates fall below half a bf16 ulp of the weights."""
    w = mlp()
    return mixprec.Workload(
        model=w.model,
        make_batch=w.make_batch,
        loss_fn=w.loss_fn,
        optimizer_fn=lambda p: torch.optim.SGD(p, lr=lr),
        name="stall",
    )


def test_pure_bf16_stagnation_is_a_stall_and_fp32_master_weights_rescue_it():
    _, fp32, _ = train(stalling(), "fp32", 300)
    alert, stalled, policy = train(stalling(), "bf16-true", 300, rescue=False)
    stall = alert.findings[0]
    assert (stall.step, stall.kind) == (0, "stall") and stall.evidence["stalled_fraction"] > 0.5
    assert "fp32 master weights" in stall.message and not alert.healthy
    assert policy.name == "bf16-true" and next(alert.model.parameters()).dtype == torch.bfloat16  # untouched
    late = lambda losses: sum(losses[-20:]) / 20  # noqa: E731
    assert late(stalled) > 1.03 * late(fp32)  # left alone, it learns visibly less than fp32

    rescued, losses, policy = train(stalling(), "bf16-true", 300, rescue=True)
    assert [f.kind for f in rescued.findings] == ["stall", "rescue"]
    assert "switched from bf16-true to bf16-mixed" in rescued.findings[1].message
    assert policy.name == "bf16-mixed" and all(p.dtype == torch.float32 for p in rescued.model.parameters())
    assert late(losses) == pytest.approx(late(fp32), rel=0.01)  # within fp32's noise band
    assert rescued.healthy


def test_a_plain_torch_amp_loop_is_watched_with_its_scaler():
    w = mixprec.load_workload(LATE)
    model, optimizer = w.model, w.make_optimizer(w.model)
    scaler = torch.amp.GradScaler("cpu")
    monitor = Monitor(model, scaler=scaler, optimizer=optimizer, loss_fn=w.loss_fn, every=EVERY, rescue=True)
    torch.manual_seed(0)
    for _ in range(300):
        batch = w.make_batch(64, torch.device("cpu"))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = w.loss_fn(model, batch)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        monitor.observe(loss, batch)
    assert kinds(monitor)[:2] == [("predicted_overflow", "head"), ("rescue", "head")]
    assert "outside autocast" in monitor.findings[1].message
    assert all(math.isfinite(v) for v in monitor.losses)


def test_healthy_runs_raise_nothing():
    monitor, _, _ = train(mlp(), "fp16-mixed", 400, rescue=True, shadow_every=50)
    assert monitor.findings == []
    monitor, _, _ = train(mixprec.load_workload(LATE), "bf16-mixed", 300)
    assert monitor.findings == []


def test_findings_go_to_a_jsonl_file(tmp_path):
    import json

    events = tmp_path / "events.jsonl"
    train(mixprec.load_workload(LATE), "fp16-mixed", 100, findings=events)
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert lines and lines[0]["kind"] == "predicted_overflow" and lines[0]["module"] == "head"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, "every must be an integer >= 1, got 0"),
        ({"shadow_every": -1}, "shadow_every must be an integer >= 0, got -1"),
        ({"scaler": object()}, "scaler must be a torch.amp.GradScaler"),
        ({"findings": 3}, "findings must be a path or a callable"),
        ({"schedule": {0.5: "fp32"}}, "a precision schedule needs the loop's mixprec Policy"),
    ],
)
def test_bad_input_is_one_clear_line_and_changes_nothing(kwargs, message):
    model = nn.Linear(2, 2)
    with pytest.raises(UsageError, match=message):
        Monitor(model, **kwargs)
    assert getattr(model, "_mixprec_monitor", None) is None
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_one_monitor_per_model_and_only_modules():
    model = nn.Linear(2, 2)
    first = Monitor(model)
    with pytest.raises(UsageError, match="already has a mixprec Monitor; close"):
        Monitor(model)
    first.close()
    Monitor(model).close()
    with pytest.raises(UsageError, match=r"watches a torch\.nn\.Module, got dict"):
        Monitor({})  # type: ignore[arg-type]


def test_a_resumed_run_judges_as_the_straight_one_did():
    """Model, optimizer, policy, monitor and RNG saved at step 100 and loaded into new objects: the
    resumed run's losses are bitwise the straight run's, and so are its findings."""

    def start():
        w = mixprec.load_workload(LATE)
        policy = mixprec.get_policy("fp16-mixed", device="cpu")
        model = policy.prepare(w.model)
        optimizer = w.make_optimizer(model)
        monitor = Monitor(model, policy, optimizer=optimizer, loss_fn=w.loss_fn, every=EVERY)
        return w, policy, model, optimizer, monitor

    def run(parts, steps):
        w, policy, model, optimizer, monitor = parts
        losses = []
        for _ in range(steps):
            batch = w.make_batch(64, torch.device("cpu"))
            with policy.autocast():
                loss = w.loss_fn(model, batch)
            optimizer.zero_grad()
            policy.backward(loss)
            policy.step(optimizer)
            monitor.observe(loss, batch)
            losses.append(float(loss.detach()))
        return losses

    torch.manual_seed(0)
    straight = start()
    expected = run(straight, 200)
    straight[-1].close()

    torch.manual_seed(0)
    first = start()
    losses = run(first, 100)
    _, policy, model, optimizer, monitor = first
    saved = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "policy": policy.state_dict(),
        "monitor": monitor.state_dict(),
        "rng": torch.get_rng_state(),
    }
    monitor.close()
    resumed = start()
    _, policy, model, optimizer, monitor = resumed
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    policy.load_state_dict(saved["policy"])
    monitor.load_state_dict(saved["monitor"])
    torch.set_rng_state(saved["rng"])
    losses += run(resumed, 100)
    assert losses == expected  # bitwise (inf == inf)
    assert [f.to_dict() for f in monitor.findings] == [f.to_dict() for f in straight[-1].findings]
    assert [f.kind for f in monitor.findings][:2] == ["predicted_overflow", "overflow"]


def test_trends_are_fitted_on_the_latest_samples_and_placed_at_their_real_steps():
    # every 2 steps: by the overflow (step ~139) the recorder holds ~70 samples, more than its window
    from mixprec.monitor import judge

    w = mixprec.load_workload(LATE)
    policy = mixprec.get_policy("fp16-mixed", device="cpu")
    model = policy.prepare(w.model)
    optimizer = w.make_optimizer(model)
    monitor = Monitor(model, policy, optimizer=optimizer, loss_fn=w.loss_fn, every=2, train_steps=300)
    torch.manual_seed(0)
    for _ in range(140):
        batch = w.make_batch(64, torch.device("cpu"))
        with policy.autocast():
            loss = w.loss_fn(model, batch)
        optimizer.zero_grad()
        policy.backward(loss)
        policy.step(optimizer)
        monitor.observe(loss, batch)
    predicted = [f for f in monitor.findings if f.kind == "predicted_overflow"]
    assert monitor.sampler.recorder.steps > judge.WINDOW
    assert predicted and predicted[0].module == "head"
    assert predicted[-1].step > 2 * judge.WINDOW  # fitted on a window that had moved
    assert abs(predicted[-1].evidence["predicted_step"] - FIRST_FP16_OVERFLOW) <= 20


def transient_overflow(at):
    """The amplified module overflows fp16 at step ``at`` only (as a scale GradScaler has not yet
    backed off from would)."""

    def fault(step, model, batch):
        model[2].gain.fill_(1e6 if step == at else 1.0)
        return batch

    return fault


def test_gradscalers_own_back_offs_are_not_news():
    """Found by the false-alarm runs: a timm ViT in fp16 skipped its third step while GradScaler was
    still finding its scale, and later backed off three times in 2,000 steps as its gradients grew;
    the monitor called each an overflow. One skip the next step does not repeat is the scaler's job;
    an overflow the precision causes persists, and is found at its second skip."""
    early, _, _ = train(amplified(), "fp16-mixed", 60, fault=transient_overflow(2))
    assert early.findings == [] and 2 in early.skipped
    late, _, _ = train(amplified(), "fp16-mixed", 130, fault=transient_overflow(120))
    assert late.findings == [] and 120 in late.skipped
    persistent, _, _ = train(amplified(), "fp16-mixed", 130, fault=overflow_from(120), findings=None)
    assert [(f.step, f.kind, f.module) for f in persistent.findings][:1] == [(121, "overflow", "2")]


def test_a_plain_loop_is_stopped_by_monitor_stop_once_the_rescues_are_spent():
    """A plain loop has no framework flag: observe() raises MonitorStop, after a ``stop`` finding
    that names what was left unanswered; record() is the same without the exception, and a
    stopped monitor records nothing more."""
    from mixprec.monitor import MonitorStop

    w = stalling()
    policy = mixprec.get_policy("bf16-true", device="cpu")
    model = policy.prepare(w.model)
    optimizer = w.make_optimizer(model)
    seen = []
    monitor = Monitor(
        model,
        policy,
        optimizer=optimizer,
        loss_fn=w.loss_fn,
        every=EVERY,
        rescue=True,
        max_rescues=0,
        findings=seen.append,
    )
    torch.manual_seed(0)
    batch = w.make_batch(32, torch.device("cpu"))
    with policy.autocast():
        loss = w.loss_fn(model, batch)
    policy.backward(loss)
    policy.step(optimizer)
    with pytest.raises(MonitorStop, match=r"step 0: stall .* after 0 rescues \(max_rescues=0\)"):
        monitor.observe(loss, batch)
    assert [f.kind for f in seen] == ["stall", "stop"] and seen[1].message == monitor.stopped
    assert policy.name == "bf16-true" and not monitor.healthy  # nothing was changed, nothing answered
    assert monitor.record(loss, batch) == [] and len(monitor.losses) == 1
    with pytest.raises(MonitorStop):
        monitor.observe(loss, batch)
    monitor.close()
