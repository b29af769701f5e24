"""The monitor in a real Accelerate loop (bf16 on a CPU): poisoned weights are found at once and
``accelerator.save_state`` writes nothing of them."""

from __future__ import annotations

import pytest
import torch
from monitor_faults import mlp

from extras import require

pytestmark = [pytest.mark.frameworks, pytest.mark.usefixtures("fresh_accelerator_state")]


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def test_accelerate_save_state_refuses_poisoned_weights(tmp_path):
    require("accelerate", "frameworks")
    from accelerate import Accelerator

    from mixprec.monitor import PoisonedCheckpointError
    from mixprec.monitor.accelerate import watch

    w = mlp()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model, optimizer = accelerator.prepare(w.model, w.make_optimizer(w.model))
    monitor = watch(accelerator, model, optimizer, loss_fn=w.loss_fn, every=10)
    torch.manual_seed(0)
    for step in range(30):
        batch = w.make_batch(32, torch.device("cpu"))
        if step == 25:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        with accelerator.autocast():
            loss = w.loss_fn(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss, batch)
    assert [(f.step, f.kind) for f in monitor.findings] == [(25, "nonfinite_weights")]
    with pytest.raises(PoisonedCheckpointError, match="holds inf/NaN"):
        accelerator.save_state(str(tmp_path / "state"))
    assert not any((tmp_path / "state").glob("*.bin")) and not any((tmp_path / "state").glob("*.safetensors"))


def accelerate_run(w, steps, **monitor_kw):
    """The regression MLP in an Accelerate loop (bf16 on a CPU) that hands the loss and batch over
    before the optimizer step, with a prepared scheduler; returns (monitor, learning rates)."""
    from accelerate import Accelerator

    from mixprec.monitor.accelerate import watch

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    optimizer = w.make_optimizer(w.model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 1000)
    model, optimizer, scheduler = accelerator.prepare(w.model, optimizer, scheduler)
    monitor = watch(accelerator, model, optimizer, loss_fn=w.loss_fn, every=20, **monitor_kw)
    torch.manual_seed(0)
    lrs = []
    for step in range(steps):
        batch = w.make_batch(32, torch.device("cpu"))
        loss = w.loss_fn(model, batch)
        accelerator.backward(loss)
        monitor.before_step(loss, batch, batch_index=step)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        monitor.observe(loss, batch)
        lrs.append(scheduler.get_last_lr()[0])
    monitor.close()
    return monitor, lrs


def test_accelerate_withholds_a_data_spike_and_its_scheduler_step(tmp_path):
    require("accelerate", "frameworks")
    from monitor_faults import regression

    monitor, lrs = accelerate_run(regression(70), 80, rescue=True, skip_list=tmp_path / "skip.json")
    assert [(f.step, f.evidence["verdict"]) for f in monitor.findings] == [(70, "data")]
    assert monitor.withheld == [70] and monitor.healthy
    assert lrs[70] == lrs[69] and lrs[71] < lrs[70] and lrs[69] < lrs[68]  # as after an overflow


def test_accelerate_replays_in_fp32_through_its_autocast_wrapper():
    """Accelerate wraps the model's forward in its autocast: the fp32 replay runs the forward it
    keeps, so a bf16-only overflow is the precision, not the data."""
    require("accelerate", "frameworks")
    from monitor_faults import regression

    monitor, _ = accelerate_run(regression(offset_at=70, norm=True), 75)
    assert [(f.step, f.kind, f.evidence.get("verdict"), f.module) for f in monitor.findings][:1] == [
        (70, "overflow", "precision", "norm")
    ]


def test_accelerate_accumulated_micro_batches_are_no_stalled_updates():
    """Issue 39 item 7: bf16 weights, gradient_accumulation_steps=4, every iteration observed as the
    module's docstring shows: `stall` at step 0 with stalled_fraction 1.0 (a micro-batch steps no
    optimizer: its weights do not move, and nothing stalled). The stalls are counted at the updates."""
    require("accelerate", "frameworks")
    from accelerate import Accelerator

    from mixprec.monitor.accelerate import watch

    w = mlp()
    w.model.to(torch.bfloat16)  # weights, and so the updates, in bf16
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=1e-2)  # updates bf16 holds
    model, optimizer = accelerator.prepare(w.model, optimizer)
    loss_fn = lambda m, batch: w.loss_fn(m, (batch[0].bfloat16(), batch[1]))  # noqa: E731
    monitor = watch(accelerator, model, optimizer, loss_fn=loss_fn, every=8)
    torch.manual_seed(0)
    for _ in range(48):
        batch = w.make_batch(32, torch.device("cpu"))
        with accelerator.accumulate(model):
            loss = loss_fn(model, batch)
            accelerator.backward(loss)
            monitor.before_step(loss, batch)
            optimizer.step()
            optimizer.zero_grad()
        monitor.observe(loss, batch)
    monitor.close()
    assert monitor.findings == []
    # each sample's share counted at the update that ends its accumulation (the 4th micro-batch)
    assert [step for step, _ in monitor.sampler.stalls] == [3, 11, 19, 27, 35, 43]
    assert max(share for _, share in monitor.sampler.stalls) < 0.05
