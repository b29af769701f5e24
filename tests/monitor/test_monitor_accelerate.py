"""The monitor in a real Accelerate loop (bf16 on a CPU): poisoned weights are found at once and
``accelerator.save_state`` writes nothing of them."""

from __future__ import annotations

import pytest
import torch
from monitor_faults import mlp

from extras import require

pytestmark = pytest.mark.frameworks


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
