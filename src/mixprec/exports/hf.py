"""The ``hf`` target: TrainingArguments flags and the model preparation for the HF Trainer.

Checked in transformers 5.23's source and run by the frameworks tier:

- The Trainer builds its Accelerator from ``bf16``/``fp16``, so it inherits Accelerate's CPU rule:
  ``TrainingArguments(fp16=True, use_cpu=True)`` trains in plain fp32 without a warning. fp16-mixed
  on a CPU is refused, and so is a GradScaler with non-default options (no flag for them).
- The Trainer calls ``model(**inputs)``: the input conversions are keyword-aware, and the bf16-true
  cast leaves ``labels`` alone (the model computes its loss from them).
- ``torch_compile=True, torch_compile_mode=...`` become the Accelerator's ``TorchDynamoPlugin``
  (backend inductor); on an Ampere GPU ``TrainingArguments`` then sets TF32 as the global fp32
  precision, so the fp32 knobs are set after ``Trainer(...)``. ``optim`` picks the class as well as
  the implementation (``adamw_torch_fused`` is AdamW, and the default on torch >= 2.8), so the
  measured implementation comes as the user's optimizer through ``optimizers=(optimizer, None)``.
  The scheduler steps unless Accelerate saw a skipped step: fp16-mixed with a fused optimizer is
  refused, as for Accelerate.
- The Trainer owns the step (``training_step`` runs forward and backward, ``_inner_training_loop``
  calls ``optimizer.step()`` and the scheduler): the step scope is refused.
- ``per_device_train_batch_size=m, gradient_accumulation_steps=k``: the Trainer accumulates itself
  (its Accelerator gets ``num_steps=1``, ``create_accelerator_and_postprocess``): it divides each
  micro-batch's loss by k unless the model normalises by ``num_items_in_batch`` (``training_step``),
  and clips, steps the optimizer and the scheduler and zeroes the gradients on every k-th micro-batch
  and the epoch's last (``do_sync_step``, ``_inner_training_loop``).
"""

from __future__ import annotations

from mixprec.exports.accelerate import accelerate_refusal
from mixprec.exports.facts import Facts
from mixprec.exports.loop import SCALER_ARGS
from mixprec.exports.prepare import helper_names, precision_lines, prepare_lines
from mixprec.exports.pytorch import PyTorchTarget
from mixprec.exports.target import Contract, Refusal, monitor_comment, step_scope_refusal
from mixprec.exports.text import DTYPE_CODE, DTYPE_SHORT, call_lines, helper_lines, helpers, preamble, py

LABELS = ("labels",)  # TrainingArguments.label_names' default for models that take labels


class HFTarget(PyTorchTarget):
    """The HF Trainer: TrainingArguments(bf16/fp16) plus the plain-PyTorch model preparation."""

    name = "hf"
    writes_fp8 = False  # its own fp8 path (if any) is not what mixprec measures: refused
    title = "HF Trainer"
    aliases = ("transformers", "huggingface")
    package = "transformers"
    verified = "5.23"

    def stack_refusal(self, facts: Facts) -> Refusal | None:
        refused = accelerate_refusal(
            facts,
            stack="the HF Trainer",
            fp16="fp16=True",
            cpu_fp16="the HF Trainer's fp16=True goes through Accelerate, which does not run fp16 autocast"
            " on a CPU: TrainingArguments(fp16=True, use_cpu=True)",
            scheduler="the Trainer's scheduler",
        )
        if refused is not None:
            return refused
        changed = {k: v for k, v in facts.scaler_changes().items() if k in SCALER_ARGS}
        if changed:
            shown = ", ".join(f"{k}={py(v)}" for k, v in changed.items())
            return Refusal(
                f"TrainingArguments has no GradScaler options ({shown}); the Trainer's scaler uses torch's"
                " defaults",
                "the default loss-scaler options with the HF Trainer, or the 'accelerate' export"
                " (GradScalerKwargs)",
            )
        if facts.finite_check:
            return Refusal(
                "the HF Trainer does not skip optimizer steps with non-finite gradients (finite_check=True)",
                "finite_check=False with the HF Trainer, or the 'pytorch', 'accelerate' or 'mixprec' export",
            )
        if facts.compiles_step:
            return step_scope_refusal(
                facts,
                "the HF Trainer owns its loop: Trainer.training_step runs forward and backward, the"
                " training loop then calls optimizer.step() and the scheduler, and torch_compile=True"
                " compiles only the model (the Accelerator's TorchDynamoPlugin), so no compiled function"
                " holds the whole step (compile_scope='step')",
                "the HF Trainer, which compiles the model (torch_compile=True)",
            )
        return None

    @staticmethod
    def flags(facts: Facts) -> list[str]:
        """The precision flags of TrainingArguments, as ``name=value`` source."""
        flags = []
        if facts.mixed is not None:
            flags.append(f"{facts.spec.accelerate}=True")
        if facts.device_type == "cpu":
            flags.append("use_cpu=True")
        if facts.micro_batch is not None:
            flags.append(f"per_device_train_batch_size={facts.micro_batch}")
        if facts.accumulates:
            flags.append(f"gradient_accumulation_steps={facts.accumulation_steps}")
        if facts.compile:
            flags += ["torch_compile=True", f"torch_compile_mode={py(facts.compile)}"]
        return [*flags, "max_grad_norm=1.0"]

    def contract(self, facts: Facts) -> Contract:
        contract = Contract(runs=[f"fp32 math mode: {facts.math_mode()}."])
        if facts.mixed is not None:
            what = (
                f"{facts.spec.accelerate}=True: the Trainer's Accelerator runs the model's forward (and the"
                " loss"
                f" it computes) under autocast({DTYPE_SHORT[facts.mixed]}); fp32 weights."
            )
            if facts.scaler is not None:
                what += (
                    " GradScaler (torch's defaults, the policy's too), unscaled before max_grad_norm clips."
                )
            contract.runs.append(what)
        else:
            contract.runs.append("No bf16/fp16 flag: the Trainer changes no dtype.")
        if facts.true is not None:
            short = DTYPE_SHORT[facts.true]
            contract.runs.append(
                f"{short} weights (cast below, no fp32 master copy), {short} inputs except labels (a forward"
                f" pre-hook), {short} default dtype during forward (forward hooks)."
            )
            contract.instead.append(
                f"{facts.name}: no flag; the model is prepared below and bf16=... stays off."
            )
        if facts.channels_last:
            contract.runs.append(
                "channels_last weights and 4-D inputs: a forward pre-hook converts keyword inputs too, as the"
                " Trainer calls model(**batch)."
            )
        if facts.keep:
            contract.instead.append(f"keep_fp32={py(facts.keep)}: keep_in_fp32() below, inside the autocast.")
        if facts.min_scale is not None:
            contract.instead.append(
                f"min_scale={py(facts.min_scale)}: the Trainer's GradScaler has no floor and no collapse"
                " alarm."
            )
        contract.runs += facts.loop_runs(
            "torch_compile=True: the Trainer's Accelerator compiles the model (backend inductor) after its"
            " autocast wrapper"
        )
        if facts.optimizer:
            contract.runs.append(
                "optimizers=(optimizer, None): the Trainer steps your optimizer (its optim, learning_rate,"
                " weight_decay and adam_* arguments no longer apply) and builds its learning-rate scheduler"
                ' around it. optim="adamw_torch_fused" would mean AdamW, fused; here it is yours.'
            )
        if facts.compile:
            contract.instead.append(
                "The fp32 math knobs are set after Trainer(...): with torch_compile on an Ampere GPU,"
                " TrainingArguments sets TF32 as torch's global fp32 precision, and the Trainer's Accelerator"
                " the legacy allow_tf32 flag when neither bf16 nor fp16 is on."
            )
        if facts.spec.is_math_mode and facts.spec.compute_format != "fp32":
            contract.instead.append(
                f"{facts.name}: set by the fp32_precision knobs below. TrainingArguments(tf32=...) stays"
                " unset:"
                " depending on the release it sets the legacy allow_tf32 flags (mixing the APIs raises) or"
                " only the global torch.backends.fp32_precision, which does not reach cuDNN convolutions."
            )
        m, k = facts.micro_batch, facts.accumulation_steps
        contract.runs += facts.batch_runs(
            f"per_device_train_batch_size={m}",
            f"gradient_accumulation_steps={k}: the Trainer divides each micro-batch's loss by {k} (a model"
            " that takes num_items_in_batch normalises over the whole step's items itself),"
            f" backpropagates every micro-batch and clips, steps the optimizer and the scheduler and"
            f" zeroes the gradients once every {k} (and on an epoch's last)",
        )
        batch, own = "batch size, ", ""
        if m is not None:  # set here: the user's arguments must not repeat them
            batch = ""
            own = "; not per_device_train_batch_size" + (" or gradient_accumulation_steps" if k > 1 else "")
        contract.fill_in = (
            "model (nn.Module or PreTrainedModel whose forward(**batch) returns the loss first or as 'loss'),"
            f" train_dataset, training_args (your other TrainingArguments: output_dir, learning_rate, {batch}"
            f"max_steps or num_train_epochs, ...{own})."
        )
        return contract

    def monitor(self, facts: Facts) -> list[str]:
        return monitor_comment("Trainer(..., callbacks=[mixprec.monitor.hf.MonitorCallback()])")

    def body(self, facts: Facts) -> list[str]:
        names = helper_names(facts)
        if facts.true is not None:
            names.append("default_dtype_in_forward")
        blocks = helpers(names)
        # With the user's optimizer the model is on its device first, as Trainer(optimizers=...) wants.
        prepare = prepare_lines(facts, move=bool(facts.optimizer), keep_kwargs=LABELS)
        if facts.true is not None:
            prepare.append(
                f"default_dtype_in_forward(model, {DTYPE_CODE[facts.true]})  # tensors forward creates"
            )
        trainer = ["model=model", "args=args", "train_dataset=train_dataset"]
        if facts.optimizer:
            prepare += ["", facts.optimizer_line(after="the casts")]
            trainer.append("optimizers=(optimizer, None)")
        knobs = precision_lines(facts)
        return [
            *preamble(
                facts.device_type,
                "import torch",
                "from transformers import Trainer, TrainingArguments",
                helpers=blocks,
            ),
            *([] if facts.compile else knobs),
            *helper_lines(blocks),
            *prepare,
            "",
            "args = TrainingArguments(",
            *(f"    {flag}," for flag in self.flags(facts)),
            "    **training_args,  # yours: output_dir, learning_rate, "
            + ("batch size, " if facts.micro_batch is None else "")
            + "max_steps, ...",
            ")",
            *call_lines("trainer = Trainer", trainer),
            *(knobs if facts.compile else []),  # after Trainer(...): it may set TF32 (see the notes)
            "trainer.train()",
        ]
