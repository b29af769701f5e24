"""The fp16 faults inside a real HF Trainer, which needs a GPU: on a CPU the Trainer's ``fp16=True``
trains in plain fp32 (Accelerate's rule), so there is nothing to overflow, and without a scaler to
skip it a bad batch's update poisons the weights before any shadow can look at the batch.

- An MLP block of a small GPT-2 overflows fp16 from step ``ONSET`` on (its output times ``GAIN``, then
  divided back: exact in fp32); the monitor finds the Trainer's GradScaler on Accelerate's
  optimizer, names the block, and with ``rescue=True`` makes it an fp32 island, after which the
  run trains on with finite losses.
- One corrupt batch (at step ``CORRUPT_AT`` its embeddings come out 1e30 times too large, as a
  broken pipeline would feed them) makes the loss non-finite in fp32 too: the scaler skips the step,
  the fp32 shadow of that batch shows the same, and the finding is the data's; the policy is not
  blamed."""

from __future__ import annotations

import math

import pytest
import torch

import mixprec
from extras import require

pytestmark = [pytest.mark.gpu, pytest.mark.frameworks]

# The block's fp16 output is ~0.01 at initialisation (max 0.028 over a batch): times 1e6 it stayed
# finite and nothing overflowed (the first GPU run, H200); times 1e9 all but 3 of 1,024 values do.
GAIN = 1e9
ONSET = 60  # past GradScaler's start-up (mixprec.monitor.scale.STARTUP_STEPS)
CORRUPT_AT = 70
BLOCK = "transformer.h.0.mlp"


def train(tmp_path, steps, *, onset=ONSET, corrupt_at=None, **monitor_kw):
    require("transformers", "frameworks")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from mixprec.monitor.hf import MonitorCallback

    w = mixprec.load_workload("hf:gpt2", seq_len=16, n_layer=1, n_embd=32, n_head=2)
    data = [{k: v[0] for k, v in w.make_batch(1, torch.device("cpu")).items()} for _ in range(steps * 2)]
    gain = {"value": 1.0, "corrupt": False, "ids": None}

    def garbage(module, args, output):
        """The corrupt batch's embeddings, in its step and in its fp32 shadow; any other batch's stay
        clean (the monitor's control batch, replayed in the same step: a step-wide fault failed it
        too, and the third H200 lease called the weights diverged instead of the batch bad)."""
        if not gain["corrupt"]:
            return output
        ids = args[0]
        if gain["ids"] is None:  # the step's own forward comes first
            gain["ids"] = ids.detach().clone()
        same = ids.shape == gain["ids"].shape and torch.equal(ids, gain["ids"])
        return output * 1e30 if same else output

    w.model.transformer.wte.register_forward_hook(garbage)

    def amplify(module, args, output):
        return output * gain["value"] / gain["value"]

    dict(w.model.named_modules())[BLOCK].register_forward_hook(amplify)

    class Onset(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == onset:
                gain["value"] = GAIN
            # the whole step is the corrupt batch's, the monitor's shadow at its end included
            gain["corrupt"], gain["ids"] = state.global_step == corrupt_at, None

    monitor = MonitorCallback(every=10, **monitor_kw)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=2,
        fp16=True,
        learning_rate=1e-4,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    Trainer(model=w.model, args=args, train_dataset=data, callbacks=[Onset(), monitor]).train()
    return monitor.monitor


def test_an_fp16_overflow_in_one_block_is_named_and_islanded_in_the_trainer(tmp_path):
    alert = train(tmp_path / "alert", 100)
    assert alert.scaler is not None  # found on Accelerate's optimizer
    first = next(f for f in alert.findings if f.kind in ("overflow", "scale_collapse"))
    assert first.module == BLOCK and ONSET <= first.step <= ONSET + 10
    assert "rescue" not in [f.kind for f in alert.findings]

    rescued = train(tmp_path / "rescued", 100, rescue=True)
    assert ("rescue", BLOCK) in [(f.kind, f.module) for f in rescued.findings]
    assert all(math.isfinite(v) for v in rescued.losses[-10:])  # the island holds the block's range


def test_a_corrupt_record_is_the_data_not_the_precision_in_the_trainer(tmp_path):
    monitor = train(tmp_path, 100, onset=10**9, corrupt_at=CORRUPT_AT)
    bad = [f for f in monitor.findings if f.kind == "bad_batch"]
    assert len(bad) == 1 and bad[0].step == CORRUPT_AT and "not blamed" in bad[0].message
    assert bad[0].step in monitor.skipped  # the scaler skipped the step; the weights never saw it
    assert not [f for f in monitor.findings if f.kind in ("overflow", "scale_collapse", "rescue")]
    assert math.isfinite(monitor.losses[-1])
