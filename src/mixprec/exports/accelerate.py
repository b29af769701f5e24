"""The ``accelerate`` target: a launch config (YAML) and the training script around an Accelerator.

Checked in accelerate 1.15's source and run by the frameworks tier:

- ``Accelerator(mixed_precision="fp16", cpu=True)`` enables autocast and the GradScaler only off
  the CPU (``self.device.type != "cpu"``); on a CPU it trains in plain fp32 without a warning.
  fp16-mixed on a CPU is refused.
- ``mixed_precision="bf16"`` on a CPU is native autocast: ``prepare()`` wraps the model's forward in
  it (and casts its outputs to fp32), ``accelerator.autocast()`` covers the loss.
- ``accelerate launch --config_file`` needs ``distributed_type`` (``load_config_from_file``).
- ``Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode=...))``: ``prepare_model``
  calls ``torch.compile`` last, around its autocast wrapper (``dynamo_config`` is the YAML's
  spelling). With a dynamo backend, ``mixed_precision="no"`` and a CUDA device, ``AcceleratorState``
  sets the legacy ``allow_tf32`` flag: the fp32 knobs are set after ``Accelerator()`` then.
- A skipped step is one whose ``optimizer.step()`` GradScaler did not call
  (``AcceleratedOptimizer.step_was_skipped``); GradScaler calls a fused optimizer's step on inf
  gradients too (the kernel skips the update), so fp16-mixed with a fused optimizer is refused.
- The step scope is the user's loop body as one ``torch.compile``'d function around the prepared
  model and optimizer (no TorchDynamoPlugin, which compiles the model alone): dynamo traces
  ``accelerator.backward``, ``clip_grad_norm_`` and ``AcceleratedOptimizer.step`` and compiles the
  wrapped optimizer's step (run on a CPU by the frameworks tier). Accelerate's fp16 path (GradScaler
  behind a patched optimizer step) exists only off the CPU, where it has not been run compiled: fp16
  with the step scope is refused.
- Gradient accumulation: ``Accelerator(gradient_accumulation_steps=k)`` and the loop body under
  ``with accelerator.accumulate(model):``, which sets ``accelerator.sync_gradients`` on every k-th
  micro-batch (and on the loader's last: ``GradientAccumulationPlugin.sync_with_dataloader``) and
  skips DDP's all-reduce on the others. ``accelerator.backward`` divides the loss by
  ``gradient_accumulation_steps`` itself (so the loop does not); ``AcceleratedOptimizer.step`` and
  ``zero_grad`` and ``AcceleratedScheduler.step`` do nothing until ``sync_gradients``; but
  ``clip_grad_norm_`` clips whatever is there, so the loop clips only when ``sync_gradients``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from mixprec.exports.facts import Facts
from mixprec.exports.loop import SCALER_ARGS, SCHEDULER, loop_head, loop_helper_names, loss_lines
from mixprec.exports.native import expects
from mixprec.exports.prepare import helper_names, precision_lines, prepare_lines
from mixprec.exports.pytorch import PyTorchTarget, step_loop
from mixprec.exports.target import Contract, Refusal, monitor_comment, step_scope_refusal
from mixprec.exports.text import DTYPE_SHORT, call_lines, helper_lines, helpers, indent, preamble, py, section


class AccelerateTarget(PyTorchTarget):
    """HF Accelerate: the plain-PyTorch preparation, Accelerator(mixed_precision=...) for the loop."""

    name = "accelerate"
    writes_fp8 = False  # its own fp8 path (if any) is not what mixprec measures: refused
    title = "HF Accelerate"
    aliases: ClassVar[tuple[str, ...]] = ()  # not the plain-PyTorch target's
    package = "accelerate"
    verified = "1.15"

    def stack_refusal(self, facts: Facts) -> Refusal | None:
        refused = accelerate_refusal(
            facts,
            stack="Accelerate",
            fp16='mixed_precision="fp16"',
            cpu_fp16="Accelerate does not run fp16 autocast on a CPU:"
            ' Accelerator(mixed_precision="fp16", cpu=True)',
            scheduler="the prepared scheduler",
        )
        if refused is not None:
            return refused
        if facts.compiles_step and facts.scaler is not None:
            return step_scope_refusal(
                facts,
                "Accelerate runs fp16 (a GradScaler behind AcceleratedOptimizer's patched step, which"
                " tells skipped steps to the scheduler) only off the CPU, and mixprec has not run that"
                " inside a compiled step (compile_scope='step')",
                "Accelerate, which compiles the model (TorchDynamoPlugin)",
            )
        return None

    @staticmethod
    def mode(facts: Facts) -> str:
        """Accelerator(mixed_precision=...): the spec's value, "no" where Accelerate has none (*-true)."""
        return facts.spec.accelerate or "no"

    def contract(self, facts: Facts) -> Contract:
        contract = Contract(runs=[f"fp32 math mode: {facts.math_mode()}."])
        mode = self.mode(facts)
        if facts.mixed is not None:
            what = (
                f'Accelerator(mixed_precision="{mode}"): autocast({DTYPE_SHORT[facts.mixed]}) around the'
                " prepared model's forward (outputs cast to fp32) and accelerator.autocast() around the loss;"
                " fp32 weights."
            )
            if facts.scaler is not None:
                what += (
                    " GradScaler with the policy's options (GradScalerKwargs); clip_grad_norm_ unscales"
                    " first;"
                    " an overflowing step is skipped and the prepared scheduler skips it too."
                )
            contract.runs.append(what)
        else:
            contract.runs.append('Accelerator(mixed_precision="no"): Accelerate changes no dtype.')
        if facts.true is not None:
            contract.runs += [
                line for line in self.policy_runs(facts) if line.startswith(DTYPE_SHORT[facts.true])
            ]
            contract.instead.append(
                f"{facts.name}: Accelerate has no such mode; the model is cast and its inputs converted"
                " below, the default dtype set around the loss."
            )
        if facts.channels_last:
            contract.runs.append("channels_last weights and 4-D inputs (a forward pre-hook).")
        if facts.keep:
            contract.instead.append(
                f"keep_fp32={py(facts.keep)}: keep_in_fp32() below (fp32 weights and inputs, outside"
                " autocast)."
            )
        if facts.finite_check:
            contract.runs.append("finite_check: the loop skips a step with non-finite gradients.")
        if facts.min_scale is not None:
            contract.instead.append(
                f"min_scale={py(facts.min_scale)}: GradScalerKwargs has no floor and no collapse alarm."
            )
        contract.runs += facts.loop_runs(
            'TorchDynamoPlugin(backend="inductor") (dynamo_config in the YAML): accelerator.prepare()'
            " compiles the model last, after its autocast wrapper",
            "torch.compile(train_step) around the prepared model and optimizer (no TorchDynamoPlugin:"
            " it would compile the model alone)",
        )
        if facts.compiles_model:
            contract.instead.append(
                "The fp32 math knobs are set after Accelerator(): with a dynamo backend and"
                ' mixed_precision="no" on a GPU it turns on the legacy allow_tf32 flag, which would make'
                " fp32 matmuls TF32."
            )
        if facts.name == "bf32":
            contract.instead.append("bf32: no Accelerate flag; the oneDNN knobs below make it bf32.")
        k = facts.accumulation_steps
        contract.runs += facts.batch_runs(
            f"the DataLoader's batch_size={facts.micro_batch}, before accelerator.prepare()",
            f"Accelerator(gradient_accumulation_steps={k}) with the loop body under"
            " accelerator.accumulate(model): accelerator.backward() divides each micro-batch's loss by"
            f" {k}, the prepared optimizer and scheduler step and zero_grad clears only on the last of"
            f" every {k} micro-batches (accelerator.sync_gradients, where the loop clips), and under DDP"
            " the other micro-batches skip the gradient all-reduce",
        )
        if facts.accumulates:
            contract.instead.append(
                "On the loader's last micro-batch Accelerate steps whatever it accumulated"
                f" (sync_with_dataloader): a pass of other than a multiple of {k} micro-batches ends in a"
                " smaller step."
            )
        contract.fill_in = (
            f"{expects(facts, counted=False)}; the optimizer and scheduler lines; num_processes /"
            " distributed_type in the YAML for more than one process (`accelerate config` writes them)."
        )
        contract.launch = "accelerate launch --config_file default_config.yaml train.py"
        return contract

    def monitor(self, facts: Facts) -> list[str]:
        return monitor_comment(
            "monitor = mixprec.monitor.accelerate.watch(accelerator, model, optimizer, loss_fn=loss_fn)",
            when="after accelerator.prepare(...)",
            then="monitor.observe(loss, batch) after optimizer.step()",
        )

    def body(self, facts: Facts) -> list[str]:
        mode = self.mode(facts)
        cpu = facts.device_type == "cpu"
        yaml = [
            "compute_environment: LOCAL_MACHINE",
            "distributed_type: 'NO'",
            "num_processes: 1",
            "mixed_precision: 'no'" if mode == "no" else f"mixed_precision: {mode}",
            f"use_cpu: {'true' if cpu else 'false'}",
        ]
        kwargs = [f'mixed_precision="{mode}"', *(["cpu=True"] if cpu else [])]
        if facts.accumulates:
            kwargs.append(f"gradient_accumulation_steps={facts.accumulation_steps}")
        utils = []
        if facts.compiles_model:
            yaml += ["dynamo_config:", "  dynamo_backend: INDUCTOR", f"  dynamo_mode: {facts.compile}"]
            kwargs.append(f'dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode={py(facts.compile)})')
            utils.append("TorchDynamoPlugin")
        if facts.scaler is not None:
            utils.insert(0, "GradScalerKwargs")
        third = ["import torch", "from accelerate import Accelerator"]
        if utils:
            third.append(f"from accelerate.utils import {', '.join(utils)}")
        if facts.scaler is not None:
            opts = facts.scaler
            accelerator = [
                "accelerator = Accelerator(",
                *(f"    {k}," for k in kwargs),
                "    kwargs_handlers=[",
                "        GradScalerKwargs(",
                *(f"            {name}={py(getattr(opts, name))}," for name in SCALER_ARGS),
                "        )",
                "    ],",
                ")",
            ]
        else:
            accelerator = call_lines("accelerator = Accelerator", kwargs)
        blocks = helpers(helper_names(facts) + loop_helper_names(facts))
        loop = (
            step_loop(
                facts,
                (
                    "    accelerator.backward(loss)",
                    "    accelerator.clip_grad_norm_(model.parameters(), 1.0)",
                ),
                autocast="accelerator.autocast()",
                skipped_note="",
            )
            if facts.compiles_step
            else self.loop(facts)
        )
        accelerator.append("# (the Accelerator arguments win over default_config.yaml when both are given)")
        if facts.compiles_model:  # the knobs after Accelerator(): it may set the legacy allow_tf32 flag
            setup = [*helper_lines(blocks), *accelerator, *precision_lines(facts)]
        else:
            setup = [*precision_lines(facts), *helper_lines(blocks), *accelerator]
        return [
            section("default_config.yaml"),
            *yaml,
            section("train.py"),
            *preamble(facts.device_type, *third, helpers=blocks),
            *setup,
            *prepare_lines(facts, move=False),
            "",
            facts.optimizer_line(after="the casts"),
            SCHEDULER,
            "model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)",
            *loop,
        ]

    @staticmethod
    def loop(facts: Facts) -> list[str]:
        """The training loop, eager or around a model that prepare() compiled."""
        if facts.accumulates:
            return AccelerateTarget.accumulating_loop(facts)
        fp16 = facts.scaler is not None
        loop = [
            loop_head(facts),
            *loss_lines(facts, autocast="accelerator.autocast()"),
            "    accelerator.backward(loss)",
            "    accelerator.clip_grad_norm_(model.parameters(), 1.0)"
            + ("  # unscales the fp16 gradients first" if fp16 else ""),
        ]
        if facts.finite_check:
            loop += [
                "    grads = [p.grad for p in model.parameters() if p.grad is not None]",
                "    if all(bool(torch.isfinite(g).all()) for g in grads):  # finite_check: skip inf/NaN"
                " steps",
                "        optimizer.step()",
                "        scheduler.step()",
            ]
        else:
            step, sched = "    optimizer.step()", "    scheduler.step()"
            if fp16:
                step += "  # skipped on overflow (accelerator.optimizer_step_was_skipped)"
                sched += "  # a prepared scheduler does not step after a skipped step"
            loop += [step, sched]
        loop.append("    optimizer.zero_grad(set_to_none=True)")
        return loop

    @staticmethod
    def accumulating_loop(facts: Facts) -> list[str]:
        """The training loop with gradient accumulation: its body under ``accelerator.accumulate``,
        which makes the prepared optimizer, scheduler and zero_grad act on every k-th micro-batch
        only; clipping (and finite_check) only there too."""
        k = facts.accumulation_steps
        fp16 = facts.scaler is not None
        body = [
            *loss_lines(facts, autocast="accelerator.autocast()", divide=False),
            f"    accelerator.backward(loss)  # divides the loss by gradient_accumulation_steps={k}",
            f"    if accelerator.sync_gradients:  # the last of {k} micro-batches: clip the summed gradients",
            "        accelerator.clip_grad_norm_(model.parameters(), 1.0)"
            + ("  # unscales the fp16 gradients first" if fp16 else ""),
        ]
        if facts.finite_check:
            body += [
                "        grads = [p.grad for p in model.parameters() if p.grad is not None]",
                "        if all(bool(torch.isfinite(g).all()) for g in grads):  # finite_check: skip inf/NaN",
                "            optimizer.step()",
                "            scheduler.step()",
            ]
        else:
            step = f"    optimizer.step()  # steps on the last of {k} micro-batches only (sync_gradients)"
            if fp16:
                step = "    optimizer.step()  # then, unless it overflowed (optimizer_step_was_skipped)"
            body += [step, "    scheduler.step()  # the prepared scheduler steps with the optimizer"]
        body.append("    optimizer.zero_grad(set_to_none=True)  # clears on the optimizer step only")
        return [
            loop_head(facts, count=False),
            f"    with accelerator.accumulate(model):  # {k} micro-batches per optimizer step",
            *indent(body, 4),
        ]


def accelerate_refusal(
    facts: Facts, *, stack: str, fp16: str, cpu_fp16: str, scheduler: str
) -> Refusal | None:
    """Accelerate's rules, which a stack that builds its Accelerator from its own flags inherits (the
    HF Trainer): ``stack`` names it in the text, ``fp16`` is its fp16 switch, ``cpu_fp16`` says what
    turns that switch on on a CPU, ``scheduler`` the scheduler a skipped step must not step."""
    if facts.mixed == torch.float16 and facts.device_type == "cpu":
        return Refusal(
            f"{cpu_fp16} trains in plain fp32, with no GradScaler and no warning",
            f"bf16-mixed with {stack}, or the 'pytorch' or 'mixprec' export for fp16-mixed on a CPU",
        )
    if facts.true == torch.float16:
        return Refusal(
            f"{stack}'s {fp16} is autocast + GradScaler over fp32 weights and its GradScaler refuses fp16"
            " gradients; fp16-true needs fp16 weights with loss scaling",
            f"fp16-mixed with {stack}, or the 'pytorch' or 'mixprec' export for fp16-true",
        )
    if facts.scaler is not None and facts.optimizer == "fused":
        return Refusal(
            "Accelerate tells a skipped step by whether optimizer.step() ran, and GradScaler always runs a"
            f" fused optimizer's step (the kernel skips an overflowing update itself): {scheduler} would"
            " step after every overflow, which the policy skips",
            f"optimizer='foreach' with {stack}, or the 'pytorch' or 'mixprec' export for {facts.name}"
            " with the fused optimizer",
        )
    return None
