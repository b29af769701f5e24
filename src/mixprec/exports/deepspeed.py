"""The ``deepspeed`` target: ds_config.json and the training script around ``deepspeed.initialize``.

Checked in deepspeed 0.19's source and run by the frameworks tier (CPU accelerator, gloo):

- ``deepspeed.initialize`` asserts without a batch size: the config always has
  ``train_micro_batch_size_per_gpu`` (a value the user fills in).
- ``"torch_autocast": {"enabled": true, "dtype": ...}`` is *-mixed: fp32 parameters and optimizer,
  autocast around the engine's forward, and for fp16 without ZeRO a ``torch.amp.GradScaler``
  (``engine.torch_autocast_z0_gradscaler``) that ``engine.step()`` unscales before clipping. The
  ``"bf16"`` / ``"fp16"`` sections are something else: half parameters with fp32 master weights in
  the optimizer and no autocast (and ``"fp16"`` is refused on CPUs without fp16 support).
- bf16-true: no precision section; the model is cast by hand and DeepSpeed steps the bf16
  parameters with the user's optimizer (no master copy), as the policy says.
- ``_broadcast_model`` views every parameter as bytes, which fails for channels_last parameters:
  channels_last is applied to the model after ``initialize``.
- ``engine.compile(compile_kwargs=...)`` compiles ``engine.module`` in place (``Module.compile``,
  the accelerator's backend: inductor on CPU and CUDA) inside the engine's autocast. Without ZeRO
  and precision sections the client optimizer is stepped as built, fused or not, through the
  GradScaler for fp16.
- No compile setting covers ``engine.step()`` (``deepspeed/compile/config.py``), and dynamo cannot
  trace the engine around it: ``engine.backward`` and its backward-graph tracker enter
  ``threading.Lock`` context managers, which dynamo cannot. The step scope is refused.
- A candidate's micro-batch and accumulation are ``train_micro_batch_size_per_gpu`` and
  ``gradient_accumulation_steps``; ``train_batch_size`` is left out: DeepSpeed derives it as their
  product times the world size (``DeepSpeedConfig._set_batch_related_parameters``) and asserts that
  equality when all three are given (``_batch_assertion``), so a written one would pin the world
  size. ``engine.backward`` divides the loss by ``gradient_accumulation_steps`` itself, and
  ``engine.step()``, called after every micro-batch, steps (unscale, clip, step, update, zero the
  gradients) only where ``is_gradient_accumulation_boundary()``: every k-th call.
"""

from __future__ import annotations

import json
from typing import ClassVar

import torch

from mixprec.exports.facts import Facts
from mixprec.exports.loop import SCHEDULER, grad_scaler_lines, loop_head, loop_helper_names, loss_lines
from mixprec.exports.native import expects
from mixprec.exports.prepare import helper_names, precision_lines, prepare_lines
from mixprec.exports.pytorch import PyTorchTarget, min_scale_lines
from mixprec.exports.target import Contract, Refusal, step_scope_refusal
from mixprec.exports.text import DTYPE_SHORT, helper_lines, helpers, preamble, py, section

_AUTOCAST_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


class DeepSpeedTarget(PyTorchTarget):
    """DeepSpeed (ZeRO off): torch_autocast for *-mixed, the plain-PyTorch preparation for the rest."""

    name = "deepspeed"
    writes_fp8 = False  # its own fp8 path (if any) is not what mixprec measures: refused
    title = "DeepSpeed"
    aliases: ClassVar[tuple[str, ...]] = ("ds",)
    package = "deepspeed"
    verified = "0.19"

    def stack_refusal(self, facts: Facts) -> Refusal | None:
        if facts.true == torch.float16:
            return Refusal(
                'DeepSpeed\'s loss scaler works only with its "fp16" section (fp16 parameters with fp32'
                " master"
                " weights) or torch_autocast (fp32 parameters); fp16-true needs fp16 weights without a master"
                " copy, with loss scaling",
                "fp16-mixed with DeepSpeed (torch_autocast), or the 'pytorch' or 'mixprec' export for"
                " fp16-true",
            )
        if facts.finite_check:
            return Refusal(
                "DeepSpeed's engine.step() does not skip steps with non-finite gradients without a loss"
                " scaler"
                " (finite_check=True)",
                "finite_check=False with DeepSpeed, or the 'pytorch', 'accelerate' or 'mixprec' export",
            )
        if facts.compiles_step:
            return step_scope_refusal(
                facts,
                "DeepSpeed's engine.step() is its own (clipping, the loss scaler, the LR scheduler,"
                " timers) and its compile settings (engine.compile(), DeepCompile) compile engine.module"
                " only; in a torch.compile'd step dynamo cannot enter the threading locks of"
                " engine.backward(), so the step runs as many small graphs with eager engine code between"
                " them, not the forward and optimizer graphs mixprec measured (compile_scope='step')",
                "DeepSpeed, which compiles its module (model_engine.compile())",
            )
        return None

    @staticmethod
    def config(facts: Facts) -> dict[str, object]:
        """ds_config.json as a dict."""
        config: dict[str, object] = {
            "train_micro_batch_size_per_gpu": facts.micro_batch or 1,
            "gradient_accumulation_steps": facts.accumulation_steps,
            "gradient_clipping": 1.0,
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
        }
        if facts.spec.deepspeed == "torch_autocast":
            assert facts.mixed is not None
            config["torch_autocast"] = {"enabled": True, "dtype": _AUTOCAST_DTYPE[facts.mixed]}
        return config

    def contract(self, facts: Facts) -> Contract:
        contract = Contract(runs=[f"fp32 math mode: {facts.math_mode()}."])
        if facts.mixed is not None:
            short = DTYPE_SHORT[facts.mixed]
            contract.runs.append(
                f'"torch_autocast" ({short}): fp32 parameters and optimizer, autocast({short}) around the'
                " engine's forward (and, in this loop, around the loss)."
            )
            contract.instead.append(
                f'DeepSpeed\'s "{short}" section stays off: it casts the parameters to'
                f" {short} with fp32 master weights in the optimizer and no autocast, which is not"
                f" {facts.name}."
            )
        if facts.scaler is not None:
            contract.runs.append(
                "Loss scaling: DeepSpeed's GradScaler for torch_autocast fp16 without ZeRO"
                " (engine.torch_autocast_z0_gradscaler), replaced by one with the policy's options;"
                " engine.step() unscales, clips, skips an overflowing step and updates the scale."
            )
            contract.instead.append(
                "The scheduler is stepped by this loop, and not after a skipped step (DeepSpeed would step"
                " it)."
            )
            if facts.min_scale is not None:
                contract.instead.append(
                    f"min_scale={py(facts.min_scale)}: the loop keeps the scale at the floor; no collapse"
                    " alarm."
                )
            contract.instead.append(
                "With ZeRO stages 1-3 DeepSpeed uses its own loss scaler instead: this export is for ZeRO"
                " off."
            )
        if facts.true is not None:
            short = DTYPE_SHORT[facts.true]
            contract.runs.append(
                f"No precision section: the model is cast to {short} before initialize() and DeepSpeed steps"
                " the"
                f" {short} parameters with your optimizer (no fp32 master copy); {short} inputs (a forward"
                f" pre-hook) and {short} default dtype around forward and loss."
            )
            contract.instead.append(
                'DeepSpeed\'s "bf16" section stays off: it keeps fp32 master weights, which is not'
                f" {facts.name}."
            )
        if facts.low is None:
            contract.runs.append("No precision section: fp32 parameters and math.")
        contract.runs.append(
            "The loop steps the scheduler once per optimizer step: where"
            " model_engine.is_gradient_accumulation_boundary(), read before model_engine.step(), also"
            " when you add gradient_accumulation_steps to ds_config.json yourself."
        )
        contract.instead.append(
            "DeepSpeed's checkpoint holds the weights and the optimizer, not this loop's scheduler"
            + (" nor its GradScaler" if facts.scaler is not None else "")
            + ": save_checkpoint(path) / load_checkpoint(path) below carry them in client_state"
        )
        contract.runs += facts.loop_runs(
            "model_engine.compile(): DeepSpeed compiles its module in place (torch.compile, backend"
            " inductor), inside the engine's autocast"
        )
        if facts.channels_last:
            contract.runs.append(
                "channels_last weights and 4-D inputs, applied after initialize(): its parameter broadcast"
                " views parameters as bytes and fails for channels_last ones."
            )
        if facts.keep:
            contract.instead.append(
                f"keep_fp32={py(facts.keep)}: keep_in_fp32() below (DeepSpeed's"
                " data_types.keep_in_fp32_modules"
                " keeps buffers only)."
            )
        m, k = facts.micro_batch, facts.accumulation_steps
        unscale = "unscale, " if facts.scaler is not None else ""
        contract.runs += facts.batch_runs(
            f'"train_micro_batch_size_per_gpu": {m} and the loader\'s batch_size={m}',
            f'"gradient_accumulation_steps": {k} (DeepSpeed derives train_batch_size = {m} x {k} x the world'
            " size): model_engine.backward() divides each micro-batch's loss by"
            f" {k}, and model_engine.step() after every micro-batch steps the optimizer ({unscale}clip,"
            f" step, zero the gradients) only on the last of every {k}, where the loop steps the scheduler",
        )
        fill_in = f"{expects(facts, counted=False)}; the optimizer and scheduler lines"
        if m is None:
            fill_in += (
                "; train_micro_batch_size_per_gpu in ds_config.json (your per-device batch size: DeepSpeed"
                " asserts without one and uses it for its own data loader and logs)"
            )
        contract.fill_in = fill_in + "."
        contract.launch = (
            "deepspeed train.py (or torchrun): initialize() needs RANK, LOCAL_RANK and WORLD_SIZE from a"
            " launcher."
        )
        return contract

    def body(self, facts: Facts) -> list[str]:
        blocks = helpers(helper_names(facts) + loop_helper_names(facts))
        lines = [
            section("ds_config.json"),
            json.dumps(self.config(facts), indent=2),
            section("train.py"),
            *preamble(facts.device_type, "import deepspeed", "import torch", helpers=blocks),
            *precision_lines(facts),
            *helper_lines(blocks),
            *prepare_lines(facts, move=False, channels_last=False),
            "",
            facts.optimizer_line(after="the casts"),
            SCHEDULER,
            "model_engine, optimizer, _, _ = deepspeed.initialize(",
            '    model=model, optimizer=optimizer, config="ds_config.json"',
            ")",
        ]
        if facts.channels_last:
            lines += [
                "model.to(memory_format=torch.channels_last)  # after initialize(): model_engine.module is"
                " model",
                "model.register_forward_pre_hook(channels_last_inputs, with_kwargs=True)",
            ]
        if facts.compile:
            mode = (
                "" if facts.compile == "default" else f"compile_kwargs={{{py('mode')}: {py(facts.compile)}}}"
            )
            lines += [
                "# measured compiled: DeepSpeed compiles its module in place; the first step compiles",
                f"model_engine.compile({mode})",
            ]
        opts = facts.scaler
        if opts is not None:
            lines += grad_scaler_lines(
                facts,
                "torch.amp.GradScaler",
                "device_type",
                target="model_engine.torch_autocast_z0_gradscaler",
            )
            lines.append("scaler = model_engine.torch_autocast_z0_gradscaler")
        lines += checkpoint_lines(facts)
        lines += [loop_head(facts, count=False), *loss_lines(facts, model="model_engine", divide=False)]
        backward = "    model_engine.backward(loss)"
        if facts.accumulates:
            backward += f"  # divides the loss by gradient_accumulation_steps={facts.accumulation_steps}"
            if opts:
                backward += ", then scales it"
        elif opts:
            backward += "  # scaled by the GradScaler above"
        lines.append(backward)
        # read before step(), which counts the micro-batch; checked without accumulation too, so a
        # gradient_accumulation_steps added to ds_config.json keeps the scheduler per optimizer step
        lines.append(
            "    boundary = model_engine.is_gradient_accumulation_boundary()  # whether step() steps"
        )
        if opts is None:
            lines += [
                "    model_engine.step()  # clips, steps, zeroes the gradients (on the boundary only)",
                "    if boundary:  # an optimizer step: the scheduler's",
                "        scheduler.step()",
            ]
        else:
            lines += [
                "    scale = scaler.get_scale()",
                "    model_engine.step()  # unscales, clips, steps unless it overflowed, updates the scale"
                " (on the boundary)",
                "    skipped = scaler.get_scale() < scale  # it backs off exactly when it skipped the step",
                *min_scale_lines(facts),
                "    if boundary and not skipped:",
                "        scheduler.step()  # a skipped step skips the scheduler too",
            ]
        return lines


def checkpoint_lines(facts: Facts) -> list[str]:
    """``save_checkpoint(path)`` / ``load_checkpoint(path)`` around the engine's own: DeepSpeed's
    checkpoint holds the weights and the optimizer, not this loop's scheduler (not given to
    initialize()) nor the GradScaler the loop installed (its loss scale restarted at init_scale
    after a resume); both travel in ``client_state``."""
    scaled = facts.scaler is not None
    state = '{"scheduler": scheduler.state_dict()' + (
        ', "grad_scaler": scaler.state_dict()}' if scaled else "}"
    )
    lines = [
        "",
        "",
        "def save_checkpoint(path):  # every rank calls it; the scheduler (and the loss scale) ride along",
        f"    client_state = {state}",
        "    model_engine.save_checkpoint(path, client_state=client_state)",
        "",
        "",
        "def load_checkpoint(path):",
        "    _, client_state = model_engine.load_checkpoint(path)",
        '    scheduler.load_state_dict(client_state["scheduler"])',
    ]
    if scaled:
        lines.append('    scaler.load_state_dict(client_state["grad_scaler"])')
    return [*lines, "", ""]
