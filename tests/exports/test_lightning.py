"""The lightning export against the real Lightning (the frameworks extra), on CPU."""

from __future__ import annotations

import math

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
    namespace = {"HalfPrecision": HalfPrecision, "torch": torch}
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


def _trainer_options(tmp_path, **changes):
    return {
        "max_steps": 3,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),
        **changes,
    }


class _BatchNormNet(L.LightningModule):
    """A CNN with BatchNorm between convolutions, as ResNets write it, trained with SGD."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1),
            torch.nn.BatchNorm2d(4),
            torch.nn.ReLU(),
            torch.nn.Conv2d(4, 4, 3, padding=1),
            torch.nn.BatchNorm2d(4),
            torch.nn.ReLU(),
        )
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
        self.norm_io: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []
        for module in self.layers:
            if isinstance(module, torch.nn.BatchNorm2d):
                module.register_forward_hook(self._record)

    def _record(self, module, args, output):
        self.norm_io.append((args[0].dtype, module.weight.dtype, output.dtype))

    def forward(self, x):
        return self.head(self.layers(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _large_activations():
    """Inputs whose convolution outputs have a variance past fp16's largest value (65504)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 4, 4, generator=generator) * 5000
    y = torch.randint(0, 2, (16,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _norms(module):
    return {n: m for n, m in module.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_stock_true_precision_casts_batch_norm_and_the_exported_plugin_does_not(precision):
    """Why the exported plugin keeps BatchNorm fp32: HalfPrecision.convert_module casts the whole
    module, BatchNorm's running statistics included, and under 16-true large activations overflow
    the running variance to inf (the model is then broken for eval)."""
    from mixprec.exports.lightning import _PLUGIN, _PLUGIN_FILE
    from mixprec.exports.snippets import source, source_in_file
    from mixprec.policy.hooks import keep_batch_norm_fp32

    x = next(iter(_large_activations()))[0]
    dtype = torch.float16 if precision == "16-true" else torch.bfloat16
    stock = HalfPrecision(precision).convert_module(_BatchNormNet())
    assert {m.running_var.dtype for m in _norms(stock).values()} == {dtype}
    if precision == "16-true":
        stock(x.to(dtype))
        assert not torch.isfinite(stock.layers[1].running_var).all()

    namespace = {"HalfPrecision": HalfPrecision, "torch": torch}
    exec("\n\n".join([*source(["keep_batch_norm_fp32"]), source_in_file(_PLUGIN_FILE, _PLUGIN)]), namespace)
    assert namespace["keep_batch_norm_fp32"].__doc__ == keep_batch_norm_fp32.__doc__
    exported = namespace[_PLUGIN](precision).convert_module(_BatchNormNet())
    assert exported.layers[0].weight.dtype == dtype and exported.head[1].weight.dtype == dtype
    for norm in _norms(exported).values():
        assert {t.dtype for t in (norm.weight, norm.bias, norm.running_mean, norm.running_var)} == {
            torch.float32
        }
    out = exported(x.to(dtype))
    assert out.dtype == dtype
    assert all(torch.isfinite(m.running_var).all() for m in _norms(exported).values())


def test_batch_norm_keeps_fp32_weights_and_statistics_under_bf16_true(tmp_path):
    """bf16-true: Lightning's HalfPrecision cast BatchNorm with the module (bf16 running statistics;
    fp16 ones overflow, see above). The export keeps its weights and statistics fp32 through fit
    and a fit(ckpt_path=...) resume, unrounded, and the layers take bf16 inputs and return bf16."""
    from harness import execute, restored_state

    import mixprec

    text = mixprec.export(mixprec.Candidate("bf16-true"), "lightning", device="cpu")
    ns = execute(
        text,
        {
            "YourLightningModule": _BatchNormNet,
            "loader": _large_activations(),
            "trainer_options": _trainer_options(tmp_path),
        },
    )
    module = ns["trainer"].lightning_module
    assert module.norm_io and set(module.norm_io) == {(torch.bfloat16, torch.float32, torch.bfloat16)}
    assert module.layers[0].weight.dtype == torch.bfloat16  # the rest of bf16-true stays
    initial = _BatchNormNet()
    for name, norm in _norms(module).items():
        tensors = {"weight": norm.weight, "bias": norm.bias, "running_var": norm.running_var}
        for what, value in tensors.items():
            assert value.dtype == torch.float32, f"{name}.{what} is {value.dtype}"
            assert torch.isfinite(value).all(), f"{name}.{what}: {value}"
        assert not torch.equal(norm.weight, initial.get_submodule(name).weight), f"{name} did not train"
        saved = norm.running_var.detach().clone()
        assert not torch.equal(saved, saved.bfloat16().float())  # not bf16 values

    checkpoint = tmp_path / "norms.ckpt"
    ns["trainer"].save_checkpoint(checkpoint)
    restored = {}

    class Restored(L.Callback):
        def on_train_start(self, trainer, module):  # after the checkpoint loaded, before any step
            restored.update({n: m.running_var.detach().clone() for n, m in _norms(module).items()})

    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[ns["HalfPrecisionKeepBatch"]("bf16-true")],
        callbacks=[Restored()],
        **_trainer_options(tmp_path, max_steps=4),
    )
    with restored_state():
        trainer.fit(ns["LitModel"](), train_dataloaders=_large_activations(), ckpt_path=str(checkpoint))
    for name, norm in _norms(module).items():
        assert restored[name].dtype == torch.float32
        assert torch.equal(restored[name], norm.running_var), f"{name}: rounded through the checkpoint"


class _TiedLM(L.LightningModule):
    """An embedding tied to the output head, as most language models write it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        return self.head(self.wte(idx))

    def training_step(self, batch, batch_idx):
        idx, target = batch
        return torch.nn.functional.cross_entropy(self(idx).flatten(0, 1).float(), target.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_keep_fp32_on_one_side_of_a_tied_weight_is_refused_at_the_start_of_fit(tmp_path):
    """bf16-true with keep_fp32 on a head tied to the embedding: refused before Lightning converts
    the model, with refuse_split_ties' reason (both paths named), as Policy.prepare refuses it."""
    from harness import execute

    import mixprec

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 16, (8, 3), generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=4)
    text = mixprec.export(mixprec.Candidate("bf16-true", keep_fp32=("head",)), "lightning", device="cpu")
    reason = r"keep_fp32 splits a tied weight: 'head.weight' is the same tensor as 'wte.weight'"
    with pytest.raises(ValueError, match=reason):
        execute(
            text,
            {"YourLightningModule": _TiedLM, "loader": loader, "trainer_options": _trainer_options(tmp_path)},
        )
    with pytest.raises(mixprec.errors.PolicyError, match=reason):
        mixprec.get_policy("bf16-true", device="cpu", keep_fp32=["head"]).prepare(_TiedLM())


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_your_own_fused_optimizer_is_clipped_under_mixed_precision(policy, tmp_path):
    """Issue 39: a LightningModule whose own configure_optimizers builds AdamW(fused=True) crashed at
    the first step with the bf16-mixed or fp16-mixed export ('does not allow for gradient clipping'):
    the export now clips such an optimizer's (unscaled) gradients itself at gradient_clip_val=1.0."""
    norms: list[float] = []

    def fused(parameters):
        optimizer = torch.optim.AdamW(parameters, lr=1e-3, fused=True)

        def seen(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

        optimizer.register_step_post_hook(seen)  # the closure ran and clipped: the gradients it stepped on
        return optimizer

    base = lightning_module_class(fused)

    class Loud(base):  # gradients far past the clip: clipping shows
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * 30

    run = run_lightning(CASES[policy], tmp_path, module=Loud)
    assert run.namespace["trainer"].global_step > 0
    finite = [n for n in norms if math.isfinite(n)]  # fp16: the overflowing batch's step is skipped
    assert len(finite) >= 3 and max(finite) <= 1.0 + 1e-3, norms
