"""The ``lightning`` target: a LightningModule subclass with the policy's hooks, and the Trainer.

Checked in lightning 2.6's source and run by the frameworks tier:

- ``Trainer(accelerator="cpu", precision="16-mixed")`` silently becomes bf16-mixed
  (``_AcceleratorConnector._check_and_init_precision``), while the ``MixedPrecision("16-mixed",
  "cpu", scaler=...)`` plugin really runs fp16 autocast with the scaler. fp16-mixed is therefore
  always exported as the plugin, on every device: one code path, one behaviour.
- ``precision="bf16-true"`` (``HalfPrecision``) casts the module, sets the default dtype in
  forward and casts every floating-point tensor of the batch, float targets included; the export
  uses a subclass that leaves the batch alone and casts the model's inputs with a pre-hook, as
  mixprec does (:mod:`mixprec.exports.snippets_lightning`). Its ``convert_module`` (called by
  ``Strategy.setup`` after ``configure_model()`` and, on one device, after ``fit(ckpt_path=...)``
  loaded the weights, before ``configure_optimizers()``) casts BatchNorm too: the subclass restores
  BatchNorm's fp32 weights and running statistics there, as ``Policy.prepare`` keeps them.
- ``16-true`` has no loss scaler: fp16-true is refused.
- ``trainer.fit(torch.compile(module))`` unwraps the ``OptimizedModule`` and compiles the module's
  ``forward`` and ``training_step`` (``lightning.pytorch.utilities.compile.from_compiled``). The
  optimizer step stays Lightning's (``loops/optimization/automatic.py`` calls
  ``optimizer.step(closure)`` around training_step and backward): the step scope is refused. The
  optimizer flag goes into ``configure_optimizers``; ``MixedPrecision.clip_gradients`` raises for an
  optimizer that unscales in its step (``_step_supports_amp_scaling``: the fused ones), bf16 too, so
  every *-mixed export writes ``configure_gradient_clipping``: a fused optimizer (the candidate's,
  or one the user's own ``configure_optimizers`` builds) is clipped there (after ``unscale_`` for
  fp16, which Lightning skips for such optimizers), any other by Lightning's own clipping.
- ``Trainer(accumulate_grad_batches=k)``: automatic optimization divides training_step's loss by k
  (``ClosureResult.from_training_step_output``), skips the optimizer step while
  ``fit_loop._should_accumulate()`` (every k-th batch steps, and the epoch's last), and steps the
  step-interval schedulers only with it; clipping and the scaler's unscale/step/update run inside
  the optimizer step, so once per k batches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mixprec.exports import snippets
from mixprec.exports.facts import Facts
from mixprec.exports.loop import grad_scaler_lines
from mixprec.exports.prepare import precision_lines
from mixprec.exports.target import Contract, ExportTarget, Refusal, monitor_comment, step_scope_refusal
from mixprec.exports.text import (
    DTYPE_CODE,
    DTYPE_SHORT,
    call_lines,
    comment,
    helper_lines,
    helpers,
    imports,
    py,
)

_PLUGIN_FILE = str(Path(__file__).with_name("snippets_lightning.py"))
_PLUGIN = "HalfPrecisionKeepBatch"
_RELATIVE = (
    "keep_fp32 patterns name modules of the model you gave mixprec; prefix them with the attribute that holds"
    " it in your LightningModule (e.g. 'net.head')"
)


class LightningTarget(ExportTarget):
    """PyTorch Lightning: Trainer precision (or precision plugin) plus LightningModule hooks."""

    name = "lightning"
    title = "PyTorch Lightning"
    aliases = ("pl", "pytorch-lightning")
    package = "lightning"
    verified = "2.6"

    def stack_refusal(self, facts: Facts) -> Refusal | None:
        if facts.true == torch.float16:
            return Refusal(
                'Lightning\'s "16-true" has no loss scaler and "16-mixed" is autocast + GradScaler over fp32'
                " weights; fp16-true needs fp16 weights with dynamic loss scaling",
                "fp16-mixed with Lightning, or the 'pytorch' or 'mixprec' export for fp16-true",
            )
        if facts.finite_check:
            return Refusal(
                "Lightning does not skip optimizer steps with non-finite gradients (finite_check=True)",
                "finite_check=False with Lightning, or the 'pytorch', 'accelerate' or 'mixprec' export",
            )
        if facts.compiles_step:
            return step_scope_refusal(
                facts,
                "Lightning's automatic optimization owns the optimizer step: the Trainer calls"
                " optimizer.step(closure) with training_step and backward inside the closure, and"
                " torch.compile(LitModel()) compiles only forward and training_step, so the optimizer"
                " step cannot join them in one compiled function (compile_scope='step')",
                "Lightning, which compiles forward and training_step",
            )
        return None

    @staticmethod
    def precision(facts: Facts) -> str:
        """The Trainer's precision string (the policy spec's Lightning name)."""
        assert facts.spec.lightning is not None, "refusal() turns away policies Lightning cannot name"
        return facts.spec.lightning

    def contract(self, facts: Facts) -> Contract:
        contract = super().contract(facts)
        contract.runs[0] += " Set in setup(), after Lightning has set up the accelerator."
        precision = self.precision(facts)
        if facts.mixed == torch.float16:
            contract.runs.append(
                f'MixedPrecision("{precision}", {py(facts.device_type)}, scaler=GradScaler(...)): fp16'
                " autocast"
                " around training_step, dynamic loss scaling with the policy's options; unscaled before"
                " gradient_clip_val clips, overflowing steps skipped. (The plugin, not"
                ' precision="16-mixed":'
                " on a CPU Lightning turns that string into bf16-mixed.)"
            )
            contract.instead.append(
                "Lightning steps LR schedulers on its own schedule, also after a skipped (overflowing) step."
            )
            if facts.min_scale is not None:
                contract.instead.append(
                    f"min_scale={py(facts.min_scale)}: GradScaler has no floor and no collapse alarm; watch"
                    " trainer.precision_plugin.scaler.get_scale() if the loss keeps overflowing."
                )
        elif facts.mixed is not None:
            contract.runs.append(
                f'precision="{precision}": autocast(bf16) around training_step, fp32 weights.'
            )
        elif facts.true is not None:
            short = DTYPE_SHORT[facts.true]
            contract.runs.append(
                f'{_PLUGIN}("{precision}") = Lightning\'s precision="{precision}" ({short} module, {short}'
                " default dtype in training_step) except that it leaves the batch alone: the pre-hook from"
                " configure_model() casts the model's inputs, float targets keep fp32 as under mixprec."
            )
            contract.runs.append(
                f"BatchNorm keeps fp32 weights and running statistics (keep_batch_norm_fp32 in {_PLUGIN}"
                f".convert_module, right after Lightning's {short} cast, with the values from before it),"
                f" taking {short} inputs and returning {short}."
            )
        else:
            contract.runs.append(f'precision="{precision}": fp32 weights and math.')
        if facts.channels_last:
            contract.runs.append(
                "channels_last: the module in configure_model(), 4-D batch tensors in"
                " on_after_batch_transfer()."
            )
        if facts.keep:
            contract.runs.append(
                f"keep_fp32={py(facts.keep)}: fp32 weights and inputs, outside autocast"
                + (" (after Lightning's conversion, in on_fit_start())." if facts.true is not None else ".")
            )
            if facts.true is not None:
                contract.runs.append(
                    "A keep_fp32 module that shares a weight with a module outside it (a tied embedding and"
                    " head) is refused in configure_model(), before the conversion: refuse_split_ties"
                    " raises ValueError naming both paths."
                )
            contract.instead.append(_RELATIVE + ".")
        contract.runs += facts.loop_runs(
            "torch.compile(LitModel()) before trainer.fit: Lightning unwraps it and compiles forward and"
            " training_step"
        )
        if self.clips_in_hook(facts):
            contract.instead.append(
                "Lightning's MixedPrecision refuses gradient_clip_val with a fused optimizer (it expects the"
                " fused step to unscale), yours too (a fused AdamW your configure_optimizers builds):"
                " configure_gradient_clipping() below clips such an optimizer's gradients at"
                " gradient_clip_val itself"
                + (", after unscaling the fp16 gradients" if facts.scaler is not None else "")
                + "; any other optimizer is clipped by Lightning, as without it."
            )
        m, k = facts.micro_batch, facts.accumulation_steps
        contract.runs += facts.batch_runs(
            f"the DataLoader's batch_size={m}",
            f"Trainer(accumulate_grad_batches={k}): Lightning divides each batch's training_step loss by"
            f" {k}, backpropagates every batch and steps the optimizer (clipping and the loss scaler"
            f" inside it), the step-interval schedulers and zero_grad once every {k} batches (and on an"
            " epoch's last batch)",
        )
        loader = "loader"
        if m is not None:
            loader = f"loader (a DataLoader with batch_size={m})"
        fill = (
            "YourLightningModule (your LightningModule class: LitModel adds the hooks to it, calling yours"
            f" first), {loader}, trainer_options (your other Trainer arguments: max_epochs, logger, ...), and"
            " LitModel's constructor arguments."
        )
        if facts.optimizer:
            fill += (
                f" configure_optimizers() replaces yours: put your optimizer and scheduler there, keeping"
                f" {facts.optimizer_flag}."
            )
        if facts.true is not None:
            fill += " training_step must call self(...): the input cast is a pre-hook on the LightningModule."
        contract.fill_in = fill
        return contract

    @staticmethod
    def clips_in_hook(facts: Facts) -> bool:
        """Whether configure_gradient_clipping() is written: under *-mixed Lightning's MixedPrecision
        raises on gradient_clip_val when the optimizer is fused (``_step_supports_amp_scaling``),
        the candidate's or the user's own (their configure_optimizers is theirs to write)."""
        return facts.mixed is not None

    def monitor(self, facts: Facts) -> list[str]:
        return monitor_comment(
            "Trainer(..., callbacks=[mixprec.monitor.lightning.MonitorCallback(rescue=True)])"
        )

    def body(self, facts: Facts) -> list[str]:
        device = py(facts.device_type)
        precision = self.precision(facts)
        third = ["import lightning as L", "import torch"]
        if facts.mixed == torch.float16:
            third.append("from lightning.pytorch.plugins.precision import MixedPrecision")
        if facts.true is not None:
            third.append("from lightning.pytorch.plugins.precision import HalfPrecision")
        names = []
        if facts.keep:
            names += ["fp32_islands", "keep_in_fp32"]
        if facts.true is not None:
            names += ["cast_inputs", "keep_batch_norm_fp32"]  # the latter for the plugin's convert_module
            if facts.keep:
                names.append("refuse_split_ties")
        if facts.channels_last:
            names.append("to_channels_last")
        blocks = helpers(names)
        if facts.true is not None:
            blocks.append(snippets.source_in_file(_PLUGIN_FILE, _PLUGIN))
        lines = [
            *imports(*third, helpers=blocks),
            *(helper_lines(blocks) if blocks else ["", ""]),
            "class LitModel(YourLightningModule):  # your LightningModule, with the policy's hooks",
            "    def setup(self, stage):",
            "        super().setup(stage)",
            *comment(
                "Here rather than at import: Lightning reads torch.get_float32_matmul_precision() when it"
                " sets"
                ' up a CUDA device, and with torch >= 2.9 that read raises once a knob is not "ieee". Not'
                " torch.set_float32_matmul_precision() as Lightning advises: that is the legacy API, which"
                " never reached cuDNN convolutions.",
                indent=8,
            ),
            *precision_lines(facts, indent_by=8, legacy_note=False),
        ]
        configure = []
        if facts.keep and facts.true is not None:
            configure.append(
                f"        refuse_split_ties(self, fp32_islands(self, {py(facts.keep)}))  # a tied weight:"
                " fp32 on both sides or neither"
            )
        if facts.channels_last:
            configure.append("        self.to(memory_format=torch.channels_last)")
        if facts.keep and facts.mixed is not None:
            configure += [
                f"        for module in fp32_islands(self, {py(facts.keep)}).values():",
                f"            keep_in_fp32(module, {device})  # keep_fp32: outside autocast, fp32 inputs",
            ]
        if facts.true is not None:
            configure.append(
                f"        self.register_forward_pre_hook(cast_inputs({DTYPE_CODE[facts.true]}),"
                " with_kwargs=True)"
            )
        if configure:
            lines += [
                "",
                "    def configure_model(self):  # before Lightning converts, moves and wraps the model",
                "        super().configure_model()",
                *configure,
            ]
        if facts.keep and facts.true is not None:
            lines += [
                "",
                f"    def on_fit_start(self):  # after Lightning's {precision} conversion of the whole"
                " module",
                "        super().on_fit_start()",
                f"        for module in fp32_islands(self, {py(facts.keep)}).values():  # keep_fp32",
                f"            keep_in_fp32(module.float(), {device}, output_dtype={DTYPE_CODE[facts.true]})",
                '        if getattr(self, "_fp32_island_state", None):  # resumed: the islands as saved',
                "            self.load_state_dict(self._fp32_island_state, strict=False)  # not rounded",
                "",
                "    def on_load_checkpoint(self, checkpoint):  # fit(ckpt_path=...) loads the weights",
                "        super().on_load_checkpoint(checkpoint)  # before its conversion rounds them: keep",
                f'        keep = tuple(n + "." for n in fp32_islands(self, {py(facts.keep)}))  # the islands',
                '        state = checkpoint["state_dict"]',
                "        self._fp32_island_state = {k: v for k, v in state.items() if k.startswith(keep)}",
            ]
        if facts.channels_last:
            lines += [
                "",
                "    def on_after_batch_transfer(self, batch, dataloader_idx):",
                "        return to_channels_last(super().on_after_batch_transfer(batch, dataloader_idx))",
            ]
        if facts.optimizer:
            flag = facts.optimizer_flag
            lines += [
                "",
                "    def configure_optimizers(self):  # yours, with the implementation mixprec measured",
                f"        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, {flag})  # yours",
                "        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 1000)  # yours",
                '        return {"optimizer": optimizer, "lr_scheduler": scheduler}',
            ]
        if self.clips_in_hook(facts):
            lines += [
                "",
                "    def configure_gradient_clipping(self, optimizer, gradient_clip_val,"
                " gradient_clip_algorithm):",
                "        # MixedPrecision.clip_gradients refuses an optimizer that unscales in its step (a",
                "        # fused one, as a fused AdamW): Lightning clips the others, this clips that one",
                '        if not getattr(optimizer, "_step_supports_amp_scaling", False):  # what Lightning'
                " reads",
                "            super().configure_gradient_clipping(optimizer, gradient_clip_val,"
                " gradient_clip_algorithm)",
                "            return",
                "        if not gradient_clip_val:",
                "            return",
            ]
            if facts.scaler is not None:
                lines.append(
                    "        self.trainer.precision_plugin.scaler.unscale_(optimizer)  # true gradients first"
                )
            lines += [
                '        if gradient_clip_algorithm == "value":',
                "            torch.nn.utils.clip_grad_value_(self.parameters(), gradient_clip_val)",
                "        else:",
                "            torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)",
            ]
        lines += ["", ""]
        accelerator = "gpu" if facts.device_type == "cuda" else "cpu"
        args = [f'accelerator="{accelerator}"']
        if facts.mixed == torch.float16:
            lines += [
                *grad_scaler_lines(facts, "torch.amp.GradScaler", device),
                f'plugin = MixedPrecision("{precision}", {device}, scaler=scaler)',
            ]
            args.append("plugins=[plugin]")
        elif facts.true is not None:
            args.append(f'plugins=[{_PLUGIN}("{precision}")]')
        else:
            args.append(f'precision="{precision}"')
        if facts.accumulates:
            args.append(f"accumulate_grad_batches={facts.accumulation_steps}")
        lines += call_lines("trainer = L.Trainer", [*args, "gradient_clip_val=1.0", "**trainer_options"])
        if not facts.compile:
            lines.append(
                "trainer.fit(LitModel(), train_dataloaders=loader)  # LitModel(your constructor arguments)"
            )
            return lines
        return [
            *lines,
            "model = LitModel()  # LitModel(your constructor arguments)",
            *facts.compile_lines(),
            "trainer.fit(model, train_dataloaders=loader)  # Lightning compiles forward and training_step",
        ]
