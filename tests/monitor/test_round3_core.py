"""Issue 39 (adversarial round 3), the Monitor core: items 4, 5, 6, 9 and 15.

4. a non-finite saved buffer (a BatchNorm ``running_var`` of inf) is never checkpointed;
5. the blame stays where it belongs: a broken data pipeline under fp16-mixed stops the run on the
   data (not with the policy's ScaleCollapseError, which names the precision), and an objective that
   diverges in strict fp32 too is not blamed on bf16 (fp32's range) nor rescued with fp32 islands;
6. a bf16 ``finite_check`` skip of a NaN batch is a ``bad_batch`` finding;
9. a Policy (or GradScaler) the loop does not step is noticed (``unwatched``);
15. the Monitor API refuses a bad ``schedule`` when it is made, a per-sample loss vector and an
    ``observe()`` after ``close()`` with one clear line each.

Each is compared with what a plain PyTorch loop does on the same run where that says something.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from monitor_faults import amplified, mlp, overflow_from, regression
from torch import nn

import mixprec
from mixprec.errors import ScaleCollapseError, UsageError
from mixprec.monitor import Monitor, MonitorStop, PoisonedCheckpointError

CPU = torch.device("cpu")
EVERY = 20


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def nan_from(onset):
    """Every batch from ``onset`` on is NaN: a data pipeline that broke."""

    def fault(step, model, batch):
        x, y = batch
        return (x * float("nan"), y) if step >= onset else batch

    return fault


def nan_at(at):
    def fault(step, model, batch):
        x, y = batch
        return (x * float("nan"), y) if step == at else batch

    return fault


def train(workload, policy_name, steps, *, fault=None, policy_options=None, monitored=True, **monitor_kw):
    """A plain loop under a mixprec Policy (with a Monitor unless ``monitored=False``) that hands the
    loss and batch over before the optimizer step. Returns (monitor, losses, policy, error): the
    exception that ended the loop early, or None."""
    policy = mixprec.get_policy(policy_name, device="cpu", **(policy_options or {}))
    model = policy.prepare(workload.model)
    optimizer = workload.make_optimizer(model)
    monitor = None
    if monitored:
        kw = {"every": EVERY, **monitor_kw}
        monitor = Monitor(model, policy, optimizer=optimizer, loss_fn=workload.loss_fn, **kw)
    torch.manual_seed(0)
    losses, error = [], None
    try:
        for step in range(steps):
            batch = workload.make_batch(workload.default_batch_size, CPU)
            if fault is not None:
                batch = fault(step, model, batch)
            with policy.autocast():
                loss = workload.loss_fn(model, batch)
            optimizer.zero_grad()
            policy.backward(loss)
            if monitor is not None:
                monitor.before_step(loss, batch, batch_index=step)
            policy.step(optimizer)
            losses.append(float(loss.detach()))
            if monitor is not None:
                monitor.observe(loss, batch)
    except (MonitorStop, ScaleCollapseError) as exc:
        error = exc
    if monitor is not None:
        monitor.close()
    return monitor, losses, policy, error


def kinds(monitor):
    return [(f.kind, f.module) for f in monitor.findings]


def hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for m in model.modules()
    )


# ---------------------------------------------------------------------------------------------
# 4. buffers are state


def bn_mlp() -> mixprec.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    w = mlp()
    return mixprec.Workload(
        model=model, make_batch=w.make_batch, loss_fn=w.loss_fn, optimizer_fn=w.optimizer_fn, name="bn"
    )


def inf_running_var(at):
    def fault(step, model, batch):
        if step == at:
            with torch.no_grad():
                model[1].running_var[3] = float("inf")
        return batch

    return fault


def test_an_inf_batchnorm_running_var_is_never_checkpointed(tmp_path):
    monitor, losses, _, _ = train(bn_mlp(), "bf16-mixed", 30, fault=inf_running_var(25))
    assert all(math.isfinite(v) for v in losses)  # training mode reads the batch's statistics: no sign
    # what a plain torch.save would keep: a resumed model whose channel 3 says nothing in eval mode
    resumed = bn_mlp().model
    resumed.load_state_dict(monitor.model.state_dict())
    with torch.no_grad():
        normalised = resumed[:2].eval()(torch.randn(8, 16))
    assert torch.equal(normalised[:, 3], resumed[1].bias[3].expand(8))  # the input is gone

    path = tmp_path / "ckpt.pt"
    with pytest.raises(PoisonedCheckpointError, match=r"step 30: 1\.running_var \(buffer\) holds inf/NaN"):
        monitor.save({"model": monitor.model.state_dict()}, path)
    assert not path.exists()
    refused = monitor.findings[-1]
    assert (refused.kind, refused.module) == ("checkpoint_refused", "1")
    assert "1.running_var (buffer)" in refused.message


class Masked(nn.Module):
    """A causal mask of -inf, by design, in a saved buffer, and a non-persistent scratch buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, x):
        return self.proj(x) @ torch.softmax(self.mask, dim=-1)


def test_a_buffer_that_is_non_finite_by_design_is_still_saved(tmp_path):
    model = Masked()
    monitor = Monitor(model)
    model.scratch.fill_(float("nan"))  # not in the state_dict: not what a checkpoint keeps
    monitor.save(model.state_dict(), tmp_path / "ok.pt")
    assert (tmp_path / "ok.pt").exists()
    model.proj.weight.data[0, 0] = float("nan")  # the weights are still checked
    with pytest.raises(PoisonedCheckpointError, match=r"proj\.weight holds inf/NaN"):
        monitor.save(model.state_dict(), tmp_path / "bad.pt")
    monitor.close()


# ---------------------------------------------------------------------------------------------
# 5. the blame


def test_a_broken_data_pipeline_stops_the_run_on_the_data_not_the_precision():
    # unwatched, the policy's own guard ends the run blaming fp16 for NaN data
    _, _, _, error = train(mlp(), "fp16-mixed", 140, fault=nan_from(80), monitored=False)
    assert isinstance(error, ScaleCollapseError) and "fp16 cannot represent" in str(error)

    for rescue in (False, True):
        monitor, losses, policy, error = train(mlp(), "fp16-mixed", 140, fault=nan_from(80), rescue=rescue)
        assert isinstance(error, MonitorStop), error  # the monitor stops it first, on the data
        assert [k for k, _ in kinds(monitor)] == ["bad_batch", "stop"], kinds(monitor)
        stop = monitor.findings[-1]
        assert stop.evidence["answers"] == "bad_batch" and stop.step < 98  # before the guard's step
        assert "data pipeline is broken, not the precision" in str(error) and "step 80" in str(error)
        assert policy.config.label == "fp16-mixed" and policy.config.keep_fp32 == ()  # nothing rescued
        assert len(losses) == stop.step + 1


def test_a_broken_data_pipeline_under_bf16_stops_on_the_data_too():
    # no loss scaler: each NaN batch is a data spike whose update rescue=True withholds, forever
    monitor, losses, _, error = train(mlp(), "bf16-mixed", 140, fault=nan_from(80), rescue=True)
    assert isinstance(error, MonitorStop) and "data pipeline is broken" in str(error)
    assert {f.evidence.get("verdict") for f in monitor.findings if f.kind == "spike"} == {"data"}
    assert [f.kind for f in monitor.findings][-1] == "stop" and len(losses) == 88
    assert "nonfinite_weights" not in [f.kind for f in monitor.findings]  # no NaN update landed


def test_a_data_stop_comes_before_a_policy_guard_that_would_fire_sooner():
    # a floor one halving below where the scale settled: the policy would give up at its 4th skip
    options = {"min_scale": 2.0**13, "max_skips_at_min_scale": 1}
    _, _, _, error = train(
        mlp(), "fp16-mixed", 100, fault=nan_from(80), policy_options=options, monitored=False
    )
    assert isinstance(error, ScaleCollapseError)
    monitor, _, _, error = train(mlp(), "fp16-mixed", 100, fault=nan_from(80), policy_options=options)
    assert isinstance(error, MonitorStop) and "ScaleCollapseError" in str(error)
    assert [k for k, _ in kinds(monitor)] == ["bad_batch", "stop"] and monitor.findings[-1].step == 82


class LogGain(nn.Module):
    """``x * 2**g``, ``g`` learnt: the objective below rewards it without bound."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x * torch.exp2(self.g)


def diverging() -> mixprec.Workload:
    """An objective that diverges in strict fp32: its loss is ``-g`` (the output enters it with
    weight 0), so SGD raises the gain by one bit a step and the outputs pass fp32's largest value
    (2**128) at about step 125."""
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(body=nn.Linear(16, 64), act=nn.ReLU(), scale=LogGain(), head=nn.Linear(64, 1))
    )
    return mixprec.Workload(
        model=model,
        make_batch=lambda b, device: (torch.randn(b, 16, device=device), torch.zeros(b, 1, device=device)),
        loss_fn=lambda m, batch: 0.0 * m(batch[0]).float().mean() - m.scale.g,
        optimizer_fn=lambda m: torch.optim.SGD(m.parameters(), lr=1.0),
        name="diverging",
        default_batch_size=32,
    )


def test_an_objective_that_diverges_in_fp32_too_is_not_blamed_on_bf16():
    # the plain fp32 loop: the outputs overflow fp32 itself
    w = diverging()
    optimizer = w.make_optimizer(w.model)
    for step in range(140):  # noqa: B007 (the step it stopped at)
        loss = w.loss_fn(w.model, w.make_batch(32, CPU))
        if not torch.isfinite(loss):
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert 110 < step < 140, step

    monitor, _, policy, _ = train(diverging(), "bf16-mixed", 100, every=10, train_steps=200, rescue=True)
    assert policy.config.keep_fp32 == ()  # no fp32 island: it would not help
    assert {k for k, _ in kinds(monitor)} == {"divergence"}, kinds(monitor)
    first = monitor.findings[0]
    assert first.module in ("scale", "head") and 110 < first.evidence["predicted_step"] < 150
    assert "strict fp32 overflows there too" in first.message and not first.action
    assert not monitor.healthy  # a run heading for inf is not healthy, whatever the precision


# ---------------------------------------------------------------------------------------------
# 6. a finite check's skip


def test_a_bf16_finite_check_skip_of_a_nan_batch_is_a_bad_batch():
    monitor, losses, policy, _ = train(
        mlp(), "bf16-mixed", 100, fault=nan_at(80), policy_options={"finite_check": True}, rescue=True
    )
    assert monitor.skipped == [80] and not math.isfinite(losses[80])
    assert kinds(monitor) == [("bad_batch", None)], kinds(monitor)
    assert monitor.findings[0].step == 80 and "the data, not the precision" in monitor.findings[0].message
    assert policy.config.keep_fp32 == () and monitor.healthy and math.isfinite(losses[-1])


def test_an_fp16_skip_of_a_nan_batch_with_a_fused_optimizer_is_a_bad_batch_not_a_spike():
    """A fused AdamW takes GradScaler's inf flag into its own kernel, so GradScaler.step calls its
    step (and the monitor's pre-step hook) on a skipped step too: the first GPU run with the HF
    Trainer (fused AdamW by default on CUDA) called such a batch a data spike and the scaler's skip
    went unexplained. The skip path judges it, as it does for a for-loop optimizer."""
    w = dataclasses.replace(
        mlp(), optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    )
    monitor, losses, policy, _ = train(w, "fp16-mixed", 100, fault=nan_at(80), rescue=True)
    assert monitor.skipped == [80] and not math.isfinite(losses[80])
    assert kinds(monitor) == [("bad_batch", None)], kinds(monitor)
    assert "the data, not the precision" in monitor.findings[0].message
    assert monitor.healthy and math.isfinite(losses[-1]) and policy.config.keep_fp32 == ()


def test_a_bf16_finite_check_skip_that_fp32_does_not_share_is_the_precisions():
    # batch 100's inputs carry an offset that bf16's moments cancel on (fp32's do not)
    w = regression(offset_at=100, norm=True)
    monitor, _, _, _ = train(w, "bf16-mixed", 110, policy_options={"finite_check": True}, spikes=False)
    assert 100 in monitor.skipped
    assert kinds(monitor)[:1] == [("overflow", "norm")], kinds(monitor)
    assert "finite in fp32" in monitor.findings[0].message


# ---------------------------------------------------------------------------------------------
# 9. a policy the loop does not use


def own_scaler_loop(monitor_for, steps=100):
    """A plain torch.amp loop that steps its own GradScaler, the amplified module overflowing fp16
    from step 60: the loop skips 40 steps. ``monitor_for(model, optimizer, scaler)`` builds the
    monitor. Returns (monitor, the loop's skips)."""
    w = amplified()
    policy = mixprec.get_policy("fp16-mixed", device="cpu")
    model = policy.prepare(w.model)
    optimizer = w.make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu")
    monitor = monitor_for(model, optimizer, scaler, policy)
    fault = overflow_from(60)
    torch.manual_seed(0)
    skips = 0
    for step in range(steps):
        batch = fault(step, model, w.make_batch(32, CPU))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = w.loss_fn(model, batch)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skips += scaler.get_scale() < before
        monitor.observe(loss, batch)
    monitor.close()
    return monitor, skips


def test_a_policy_the_loop_does_not_step_is_noticed():
    monitor, skips = own_scaler_loop(lambda m, o, s, p: Monitor(m, p, optimizer=o, every=EVERY))
    assert skips == 40 and monitor.skipped == []  # the monitor's policy never saw one
    unwatched = [f for f in monitor.findings if f.kind == "unwatched"]
    assert len(unwatched) == 1 and unwatched[0].step == 0, kinds(monitor)
    assert "Policy (fp16-mixed) never did" in unwatched[0].message
    assert "policy.step(optimizer)" in unwatched[0].message and "scaler=" in unwatched[0].message
    assert not monitor.healthy

    # no optimizer to hook: noticed after UNCONFIRMED_STEPS steps all the same
    monitor, _ = own_scaler_loop(lambda m, o, s, p: Monitor(m, p, every=EVERY))
    assert [f.step for f in monitor.findings if f.kind == "unwatched"] == [49]

    # a GradScaler the loop does not step
    other = torch.amp.GradScaler("cpu")
    monitor, _ = own_scaler_loop(lambda m, o, s, p: Monitor(m, scaler=other, optimizer=o, every=EVERY))
    assert [f.kind for f in monitor.findings][:1] == ["unwatched"]
    assert "GradScaler never scaled a loss" in monitor.findings[0].message

    # the loop's own scaler, given: watched, its skips seen, nothing unwatched
    monitor, skips = own_scaler_loop(lambda m, o, s, p: Monitor(m, scaler=s, optimizer=o, every=EVERY))
    assert "unwatched" not in [f.kind for f in monitor.findings]
    assert len(monitor.skipped) == skips == 40


# ---------------------------------------------------------------------------------------------
# 15. the API


@pytest.mark.parametrize(
    ("schedule", "policy_name", "message"),
    [
        (
            {0.5: "fp33"},
            "bf16-mixed",
            r"schedule \{0\.5: 'fp33'\}: unknown policy 'fp33'; valid: fp32, tf32, bf32, bf16-mixed, "
            r"fp16-mixed\. Did you mean 'fp32'\?",
        ),
        (
            {0.5: "bf16-true"},
            "bf16-mixed",
            r"a switch to 'bf16-true' would narrow the weights .* Use 'bf16-mixed'",
        ),
        ({30: "16-true"}, "fp16-mixed", r"a switch to 'fp16-true' .* Use 'fp16-mixed'"),
        ({0.5: "fp8-rowwise"}, "bf16-mixed", r"a switch to 'fp8-rowwise' needs its layers converted"),
        ({0.5: "fp32"}, "bf16-true", r"on a 'bf16-true' run: .* train under 'bf16-mixed'"),
    ],
)
def test_a_bad_schedule_is_refused_when_the_monitor_is_made(schedule, policy_name, message):
    policy = mixprec.get_policy(policy_name, device="cpu")
    model = policy.prepare(mlp().model)
    before = hooks(model)
    with pytest.raises(UsageError, match=message):
        Monitor(model, policy, schedule=schedule, train_steps=60)
    assert getattr(model, "_mixprec_monitor", None) is None and hooks(model) == before


def test_a_good_schedule_switches_at_its_step_and_takes_an_alias():
    monitor, _, policy, _ = train(mlp(), "fp16-mixed", 60, schedule={0.5: "bf16"}, train_steps=60)
    assert [(f.step, f.kind) for f in monitor.findings] == [(30, "schedule")]
    assert policy.name == "bf16-mixed" and monitor.config.schedule == {0.5: "bf16-mixed"}


def test_a_per_sample_loss_vector_is_one_clear_line():
    w = mlp()
    model = w.model
    monitor = Monitor(model, loss_fn=w.loss_fn, every=EVERY)
    x, y = w.make_batch(8, CPU)
    per_sample = F.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(UsageError, match=r"observe\(\) takes the step's loss as a scalar, got a tensor of "
                       r"shape \[8\] .* observe\(loss\.mean\(\), batch\)"):  # fmt: skip
        monitor.observe(per_sample, (x, y))
    with pytest.raises(UsageError, match=r"before_step\(\) takes the step's loss as a scalar"):
        monitor.before_step(per_sample, (x, y))
    monitor.observe(per_sample.mean(), (x, y))  # reduced: recorded
    assert len(monitor.losses) == 1
    monitor.close()


def test_a_closed_monitor_stays_closed():
    w = mlp()
    model, optimizer = w.model, w.make_optimizer(w.model)
    bare = hooks(model)
    monitor = Monitor(model, optimizer=optimizer, loss_fn=w.loss_fn, every=EVERY)
    batch = w.make_batch(32, CPU)
    loss = w.loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    monitor.observe(loss, batch)
    monitor.close()
    assert hooks(model) == bare
    with pytest.raises(UsageError, match=r"observe\(\) after close\(\): this Monitor was closed at step 1"):
        monitor.observe(loss, batch)
    assert monitor.record(loss, batch) == [] and monitor.before_step(loss, batch) is None
    assert hooks(model) == bare and monitor.step == 1 and len(monitor.losses) == 1
    monitor.close()  # twice: nothing more
    Monitor(model).close()  # the model is free for a new monitor
