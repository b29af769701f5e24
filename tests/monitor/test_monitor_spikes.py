"""Issue 37: loss and gradient spikes found as they happen, diagnosed before their update lands by
replaying the batch from the same weights (fp32 spikes too: the data; fp32 is fine and the policy
spikes again: the precision, its module named; neither: transient), and, with ``rescue=True``, the
bad update never applied: a data spike's withheld and its batch on the skip list, a precision
spike's module an fp32 island, a transient one retried. Through a plain loop with a mixprec Policy,
``mixprec.monitor.train`` and ``mixprec train``; the faults come from
:mod:`mixprec.monitor.faults` and tests/monitor/monitor_faults.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from monitor_faults import BAD_AT, loop, regression

import mixprec
from mixprec.cli import main
from mixprec.errors import UsageError
from mixprec.monitor import Monitor, MonitorConfig
from mixprec.monitor.faults import FaultInjector
from mixprec.monitor.train import train

HERE = Path(__file__).parent
FAULTS = str(HERE / "monitor_faults.py")
LATE = str(HERE.parents[1] / "examples" / "late_overflow.py") + ":workload"
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def spikes(monitor):
    """The diagnosed events: spikes, and the non-finite ones the precision makes (overflows)."""
    return [(f.step, f.evidence["verdict"], f.module) for f in monitor.findings if "verdict" in f.evidence]


def late(losses):
    return sum(losses[-20:]) / 20


def test_a_bad_batch_is_a_data_spike_and_with_rescue_its_update_never_lands(tmp_path):
    """The issue's run: bf16-mixed, batch 150's targets 1000x. Left alone the one update damages the
    weights for good (the loss ends far above the clean run's) and the run is not healthy; rescued,
    the update is withheld, the batch is on the skip list, and the run ends where the clean one does."""
    clean, clean_losses, _, _ = loop(regression(), 300)
    assert clean.findings == [] and clean.healthy

    alert, damaged, _, _ = loop(regression(BAD_AT), 300)
    assert spikes(alert) == [(BAD_AT, "data", None)], alert.findings
    found = alert.findings[0]
    assert found.evidence["batch_index"] == BAD_AT and found.evidence["loss"] > 1e5
    low, high = found.evidence["loss_range"]
    assert low < high < 10 and found.evidence["fp32_loss"] > 1e5
    assert found.action == "" and not alert.healthy and alert.withheld == []
    assert late(damaged) > 3 * late(clean_losses)  # the bad update damaged the run for good

    skip_list = tmp_path / "skip_batches.json"
    rescued, losses, policy, _ = loop(regression(BAD_AT), 300, rescue=True, skip_list=skip_list)
    assert spikes(rescued) == [(BAD_AT, "data", None)]
    assert "update was withheld" in rescued.findings[0].action and rescued.healthy
    assert rescued.withheld == [BAD_AT] and json.loads(skip_list.read_text()) == [BAD_AT]
    assert policy.config.keep_fp32 == ()  # the precision is not blamed
    assert late(losses) == pytest.approx(late(clean_losses), rel=0.10)


def test_a_layer_whose_bf16_output_overflows_on_one_batch_is_a_precision_spike_named_and_rescued():
    """Batch 100's inputs carry an offset the bf16 moments of the first layer cancel on: its output
    is inf/NaN under bf16-mixed, fine in fp32. Called precision (not data), the module named as the
    overflow path names it; rescued, the update is withheld and the module becomes an fp32 island."""
    alert, _, _, _ = loop(regression(offset_at=100, norm=True), 110)
    assert spikes(alert)[:1] == [(100, "precision", "norm")], alert.findings
    assert "fp32 is fine" in alert.findings[0].message and not alert.healthy

    rescued, losses, policy, _ = loop(regression(offset_at=100, norm=True), 160, rescue=True)
    kinds = [(f.kind, f.module) for f in rescued.findings]
    assert kinds == [("overflow", "norm"), ("rescue", "norm")], rescued.findings
    assert policy.config.keep_fp32 == ("norm",) and rescued.withheld == [100]
    assert all(math.isfinite(v) for v in losses[101:]) and rescued.healthy
    assert all(torch.isfinite(p).all() for p in rescued.model.parameters())


def transient_head(step=150, **kw):
    def build(model, optimizer):
        return FaultInjector(model, module="head", steps={step}, transient=True, **kw).attach(optimizer)

    return build


def test_a_fault_in_one_forward_only_is_transient_and_retried_as_if_it_never_happened():
    _, clean_losses, _, _ = loop(regression(), 200)
    alert, _, _, injector = loop(regression(), 200, faults=transient_head())
    assert injector.injected == [150] and spikes(alert) == [(150, "transient", None)]
    assert "does not reproduce" in alert.findings[0].message and not alert.healthy

    rescued, losses, _, _ = loop(regression(), 200, faults=transient_head(), rescue=True)
    assert spikes(rescued) == [(150, "transient", None)] and "retried" in rescued.findings[0].action
    # the retried update is the clean run's: the run goes on as if the fault never happened
    assert losses[151:] == pytest.approx(clean_losses[151:], rel=1e-5) and rescued.healthy


def test_the_same_fault_in_every_forward_of_its_step_fails_any_batch_so_it_is_not_the_data():
    """Replayed in fp32 it reproduces, and so it does on a batch whose loss was normal: the step's
    weights (here its module) fail on any batch, which no batch skip answers (it was called 'data')."""
    persistent = lambda model, optimizer: FaultInjector(model, module="head", steps={150}).attach(optimizer)  # noqa: E731
    monitor, _, _, _ = loop(regression(), 160, faults=persistent)
    assert spikes(monitor) == [(150, "diverged", None)]
    assert not monitor.stopped  # (once: withheld, not a run that diverges)


def test_faults_at_a_known_rate_are_each_found_and_nothing_else():
    """Megatron's RerunErrorInjector style: transient faults at a rate (2% of the steps, drawn from
    a seed), into the loss (inf) and into the gradient (NaN, seen with spike_grad_norm)."""

    w = regression()
    made = []

    def loss_faults(model, optimizer):
        made.append(FaultInjector(model, where="loss", fault="inf", rate=0.02, seed=3, transient=True))
        return made[-1].attach(optimizer)

    loss_fn = w.loss_fn  # the loop and the monitor's replays call the loss through the injector
    w.loss_fn = lambda m, b: made[-1].loss_fn(loss_fn)(m, b)
    monitor, _, _, injector = loop(w, 300, faults=loss_faults, rescue=True)
    assert injector.injected == [s for s in range(300) if injector.armed(s)] and len(injector.injected) >= 3
    # a non-finite value is a spike at any step, the warm-up's too
    assert [(s, verdict) for s, verdict, _ in spikes(monitor)] == [
        (s, "transient") for s in injector.injected
    ]
    assert monitor.healthy

    def grad_faults(model, optimizer):
        return FaultInjector(model, where="gradient", fault="nan", rate=0.02, seed=3, transient=True).attach(
            optimizer
        )

    monitor, _, _, injector = loop(regression(), 300, faults=grad_faults, spike_grad_norm=True, rescue=True)
    assert [(s, verdict) for s, verdict, _ in spikes(monitor)] == [
        (s, "transient") for s in injector.injected
    ]
    assert monitor.healthy


def test_a_spike_the_monitor_cannot_replay_is_still_reported_undiagnosed():
    # a loop that hands nothing over before the step: found after its update landed
    after, _, _, _ = loop(regression(BAD_AT), 160, before=False)
    assert spikes(after) == [(BAD_AT, "undiagnosed", None)]
    assert "Monitor.before_step" in after.findings[0].message and not after.healthy
    # no loss_fn to replay with: found before the update, but not diagnosed, and not withheld
    w = regression(BAD_AT)
    policy = mixprec.get_policy("bf16-mixed", device="cpu")
    model = policy.prepare(w.model)
    optimizer = w.make_optimizer(model)
    monitor = Monitor(model, policy, optimizer=optimizer, every=20, rescue=True)
    torch.manual_seed(0)
    for _ in range(160):
        batch = w.make_batch(32, CPU)
        with policy.autocast():
            loss = w.loss_fn(model, batch)
        optimizer.zero_grad()
        policy.backward(loss)
        monitor.before_step(loss, batch)
        policy.step(optimizer)
        monitor.observe(loss, batch)
    assert spikes(monitor) == [(BAD_AT, "undiagnosed", None)] and monitor.withheld == []
    assert not monitor.healthy
    monitor.close()


def test_spikes_off_finds_none():
    monitor, _, _, _ = loop(regression(BAD_AT), 160, spikes=False)
    assert spikes(monitor) == []


def test_spikes_off_with_a_handed_over_grad_norm_steps_the_optimizer():
    """No detector looks before the update: a gradient norm handed over is staged and asked of none
    (the gate's quick limit was min() of no detector, a ValueError inside optimizer.step)."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model, optimizer=optimizer, spikes=False)
    for _ in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        monitor.before_step(loss, grad_norm=1.0)
        optimizer.step()
        monitor.observe(loss)
    assert monitor.step == 3 and monitor.withheld == [] and monitor.findings == []
    monitor.close()


# ---------------------------------------------------------------------------------------- train()
def test_train_diagnoses_each_kind_before_the_update_and_records_what_it_withheld(tmp_path):
    from monitor_faults import precision_mlp, transient_mlp

    config = MonitorConfig(every=20, rescue=True)
    data = train(regression(BAD_AT), "bf16-mixed", 160, config=config, skip_list=tmp_path / "skip.json")
    assert [(f["step"], f["evidence"]["verdict"]) for f in data.findings] == [(BAD_AT, "data")]
    assert data.withheld == [BAD_AT] and data.skipped_batches == [BAD_AT] and data.healthy
    assert json.loads((tmp_path / "skip.json").read_text()) == [BAD_AT]

    precision = train(precision_mlp(), "bf16-mixed", 110, config=config)
    assert [(f["kind"], f["module"]) for f in precision.findings] == [
        ("overflow", "norm"),
        ("rescue", "norm"),
    ]
    assert precision.findings[0]["evidence"]["verdict"] == "precision"
    assert precision.final_policy["keep_fp32"] == ["norm"] and precision.healthy

    w = transient_mlp()
    transient = train(w, "bf16-mixed", 110, config=config)
    assert w.faults.injected == [100]
    assert [(f["step"], f["evidence"]["verdict"]) for f in transient.findings] == [(100, "transient")]
    assert transient.withheld == [] and transient.healthy


def test_the_late_fp16_overflow_is_still_the_precision_named_head_with_spikes_on():
    result = train(mixprec.load_workload(LATE), "fp16-mixed", 300, config=MonitorConfig(every=20))
    kinds = [(f["kind"], f["module"]) for f in result.findings]
    assert kinds[0] == ("predicted_overflow", "head") and ("overflow", "head") in kinds
    overflow = next(f for f in result.findings if f["kind"] == "overflow")
    assert overflow["evidence"]["verdict"] == "precision"  # diagnosed before its update: not the data
    assert "spike" not in [k for k, _ in kinds]


# ----------------------------------------------------------------------------------- mixprec train
def _cli(tmp_path, factory, *extra):
    argv = ["train", "--workload", f"{FAULTS}:{factory}", "--policy", "bf16-mixed", "--steps", "300"]
    return main([*argv, "--device", "cpu", "--out", str(tmp_path), *extra])


def test_mixprec_train_exits_4_on_a_data_spike_and_with_rescue_ends_where_the_clean_run_does(
    tmp_path, capsys
):
    """The issue's first run: it ended `healthy`, exit 0, no finding and no events.jsonl."""
    assert _cli(tmp_path / "clean", "clean_mlp") == 0
    clean = json.loads((tmp_path / "clean" / "train.json").read_text())

    assert _cli(tmp_path / "alert", "bad_batch_mlp") == 4
    out = capsys.readouterr().out
    assert f"step {BAD_AT}: spike: data:" in out and "the run ended not healthy" in out
    events = [json.loads(line) for line in (tmp_path / "alert" / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["kind"], e["evidence"]["verdict"]) for e in events] == [(BAD_AT, "spike", "data")]
    assert not (tmp_path / "alert" / "skip_batches.json").exists()

    assert _cli(tmp_path / "rescued", "bad_batch_mlp", "--rescue") == 0
    rescued = json.loads((tmp_path / "rescued" / "train.json").read_text())
    assert rescued["withheld"] == [BAD_AT] and rescued["healthy"] is True
    assert json.loads((tmp_path / "rescued" / "skip_batches.json").read_text()) == [BAD_AT]
    assert late(rescued["losses"]) == pytest.approx(late(clean["losses"]), rel=0.10)


def test_an_optimizer_fn_whose_parameter_is_not_named_model_trains(tmp_path):
    """The issue's second run stopped with "'generator' object has no attribute 'parameters'"."""
    w = regression()
    assert w.make_optimizer(w.model).__class__ is torch.optim.AdamW
    assert _cli(tmp_path, "clean_mlp", "--steps", "5") == 0


def test_an_optimizer_fn_that_fails_both_ways_is_one_line_naming_it():
    w = regression()
    w.optimizer_fn = lambda m: torch.optim.AdamW(m.params())
    with pytest.raises(
        UsageError, match=r"optimizer_fn <lambda> \(test_monitor_spikes\.py:\d+\) .* takes the model"
    ):
        train(w, "bf16-mixed", 3)


def test_a_fault_injector_refuses_what_it_cannot_do():
    model = regression().model
    with pytest.raises(UsageError, match=r"fault must be one of spike, nan, inf, got 'zero'"):
        FaultInjector(model, fault="zero")
    with pytest.raises(UsageError, match=r"module 'neck' is not in the model; valid: '' \(the model\), body"):
        FaultInjector(model, module="neck")
    with pytest.raises(UsageError, match=r"rate must be a number in \[0, 1\]"):
        FaultInjector(model, rate=2)


def test_a_fault_goes_where_it_is_asked_and_only_there():
    """Each kind of fault into each place, persistent and transient, counted as it happens."""
    model = regression().model
    x = torch.randn(4, 16)
    with FaultInjector(model, module="head", fault="nan", steps={1}) as faults:
        assert torch.isfinite(model(x)).all()  # step 0: not armed
        faults.step = 1
        assert torch.isnan(model(x)).all() and torch.isnan(model(x)).all()  # persistent: every forward
        assert faults.injected == [1]
    assert torch.isfinite(model(x)).all()  # closed: the model computes as before

    with FaultInjector(
        model, where="gradient", module="body", fault="inf", steps={0}, transient=True
    ) as faults:
        model(x).sum().backward()
        assert torch.isinf(model.body.weight.grad).any() and torch.isfinite(model.head.weight.grad).all()
        model.zero_grad()
        model(x).sum().backward()  # the replay of the step: clean
        assert torch.isfinite(model.body.weight.grad).all() and faults.injected == [0]

    faults = FaultInjector(model, where="loss", fault="spike", factor=10.0, steps={0})
    loss_fn = faults.loss_fn(lambda m, b: m(b).pow(2).mean())
    assert loss_fn(model, x).item() == pytest.approx(10 * model(x).pow(2).mean().item())
    assert not model._forward_hooks and not model._backward_pre_hooks  # the loss's fault hooks nothing
    with (
        FaultInjector(model) as activation,
        pytest.raises(UsageError, match=r"wraps the loss for where='loss'"),
    ):
        activation.loss_fn(loss_fn)


def test_a_run_that_diverges_in_fp32_too_is_not_called_a_bad_batch():
    """Issue 51 round 3: a learning rate too large for the objective: the loss passes 1e16, then
    inf, in strict fp32 as much as in bf16. Each step's batch replayed in fp32 is inf, and so is a
    batch whose loss was normal: the weights fail on any batch. It was 'data' (and then 'the data
    pipeline is broken') at the step fp32 itself died; it is a divergence, each update withheld,
    and the run is stopped as one."""
    from mixprec.monitor.core import MonitorStop

    w = regression()
    w.optimizer_fn = lambda params: torch.optim.SGD(params, lr=0.6, momentum=0.9)
    made = {}

    def keep(model, optimizer):
        made["model"] = model  # (the monitor is reached through the model it watches)

    with pytest.raises(MonitorStop, match="the weights fail on every batch, in strict fp32 too"):
        loop(w, 60, policy_name="bf16-mixed", rescue=True, faults=keep)
    monitor = made["model"]._mixprec_monitor
    verdicts = {verdict for _, verdict, _ in spikes(monitor)}
    assert "diverged" in verdicts and "data" not in verdicts, spikes(monitor)
    assert not any(f.kind == "bad_batch" for f in monitor.findings)
    assert not monitor.healthy
