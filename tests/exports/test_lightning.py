"""The lightning export against the real Lightning (the frameworks extra), on CPU."""

from __future__ import annotations

import pytest
import torch
from harness import (
    ACC_STEPS,
    CASES,
    FRAMEWORK_TOLERANCE,
    STEP_CASES,
    accumulating,
    check_accumulation,
    counting_steps,
    lightning_module_class,
    micro_loader,
    require,
    run_case,
    run_lightning,
    sgd,
)

require("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision  # noqa: E402

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]

# tf32: a CUDA math mode. fp16-true: Lightning's 16-true has no loss scaler. The step scope: Lightning's
# automatic optimization owns the optimizer step.
REFUSED = {"tf32", "fp16-true", *STEP_CASES}


@pytest.mark.parametrize("case", CASES)
def test_export_runs_the_policy(case, tmp_path):
    run_case("lightning", case, REFUSED, lambda config: run_lightning(config, tmp_path))


def test_the_16_mixed_string_on_a_cpu_is_bf16_without_a_scaler():
    """Why fp16-mixed is exported as the MixedPrecision plugin: the string silently becomes bf16."""
    with pytest.warns(UserWarning, match="Using `precision='bf16-mixed'` instead"):
        trainer = L.Trainer(accelerator="cpu", precision="16-mixed", logger=False)
    assert trainer.precision_plugin.precision == "bf16-mixed"
    assert trainer.precision_plugin.scaler is None


def test_stock_bf16_true_rounds_float_targets_and_the_exported_plugin_does_not():
    """Why bf16-true uses HalfPrecisionKeepBatch: HalfPrecision casts the whole batch."""
    from mixprec.exports.lightning import _PLUGIN, _PLUGIN_FILE
    from mixprec.exports.snippets import source_in_file

    batch = (torch.randn(2, 3), torch.randn(2, 2))
    assert HalfPrecision("bf16-true").convert_input(batch)[1].dtype == torch.bfloat16
    namespace = {"HalfPrecision": HalfPrecision}
    exec(source_in_file(_PLUGIN_FILE, _PLUGIN), namespace)
    plugin = namespace[_PLUGIN]("bf16-true")
    assert plugin.convert_input(batch)[1].dtype == torch.float32
    with plugin.forward_context():
        assert torch.get_default_dtype() == torch.bfloat16  # the rest of bf16-true stays


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_refuses_to_clip_a_fused_optimizer(precision):
    """Why a fused optimizer under *-mixed clips in configure_gradient_clipping(): Lightning's
    MixedPrecision raises on gradient_clip_val, bf16 (no scaler) included."""
    params = [torch.nn.Parameter(torch.ones(2))]
    plugin = MixedPrecision(precision, "cpu")
    with pytest.raises(RuntimeError, match="fused"):
        plugin.clip_gradients(torch.optim.AdamW(params, fused=True), clip_val=1.0)
    plugin.clip_gradients(torch.optim.AdamW(params, foreach=True), clip_val=1.0)


def test_an_island_stays_fp32_through_a_checkpoint_resume(tmp_path):
    """Issue 26: resumed with fit(ckpt_path=...), a bf16-true fp32 island's weights came back
    bf16-rounded (Lightning loads the state into the module it converted to bf16 whole)."""
    from harness import data_loader, execute, lightning_module_class, restored_state

    import mixprec

    text = mixprec.export(mixprec.Candidate("bf16-true", keep_fp32=("head",)), "lightning", device="cpu")
    options = {
        "max_steps": 3,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),
    }
    ns = execute(
        text,
        {
            "YourLightningModule": lightning_module_class(),
            "loader": data_loader(False),
            "trainer_options": options,
        },
    )
    checkpoint = tmp_path / "island.ckpt"
    ns["trainer"].save_checkpoint(checkpoint)
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    saved = state["head.1.weight"]
    assert saved.dtype == torch.float32 and not torch.equal(
        saved, saved.bfloat16().float()
    )  # not bf16 values

    restored = {}

    class Restored(L.Callback):
        def on_train_start(self, trainer, module):  # after the checkpoint loaded, before any step
            restored["head"] = module.head[1].weight.detach().clone()

    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[ns["HalfPrecisionKeepBatch"]("bf16-true")],
        callbacks=[Restored()],
        **{**options, "max_steps": 5},
    )
    with restored_state():  # the export's setup() sets the fp32 math mode, as the first fit did
        trainer.fit(ns["LitModel"](), train_dataloaders=data_loader(False), ckpt_path=str(checkpoint))
    assert restored["head"].dtype == torch.float32 and torch.equal(restored["head"], saved)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_accumulation_steps_once_per_effective_batch(policy, tmp_path):
    """Trainer(accumulate_grad_batches=3) over DataLoader(batch_size=4): every optimizer step sees 12
    samples, and the weights are the plain reference loop's (loss / 3 per micro-batch)."""
    source = accumulating(policy)
    with counting_steps():
        run = run_lightning(
            source,
            tmp_path,
            loader=micro_loader(),
            module=lightning_module_class(sgd),
            options={"max_steps": ACC_STEPS},
        )
    check_accumulation(source, run, "lightning", scheduler=False, **FRAMEWORK_TOLERANCE)
