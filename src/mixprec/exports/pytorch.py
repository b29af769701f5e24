"""The ``pytorch`` target: plain PyTorch without mixprec.

fp32_precision knobs, autocast or the half default dtype, GradScaler with unscale-before-clip and
skipped-step accounting, channels_last, half casts and fp32 islands: everything
:class:`mixprec.Policy` does, written out. :class:`~mixprec.exports.fsdp2.FSDP2Target` extends it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from mixprec.exports.facts import Facts
from mixprec.exports.loop import (
    SCHEDULER,
    accumulate_lines,
    accumulation_lines,
    grad_scaler_lines,
    loop_head,
    loop_helper_names,
    loss_lines,
)
from mixprec.exports.native import expects
from mixprec.exports.prepare import helper_names, precision_lines, prepare_lines
from mixprec.exports.target import Contract, ExportTarget, monitor_comment
from mixprec.exports.text import DTYPE_SHORT, comment, helper_lines, helpers, preamble, py


class PyTorchTarget(ExportTarget):
    """Plain PyTorch: every policy is expressible."""

    name = "pytorch"
    writes_fp8 = True
    title = "plain PyTorch"
    aliases: ClassVar[tuple[str, ...]] = ("torch", "plain")
    optimizer_after: ClassVar[str] = "the casts"  # what the optimizer line says to build it after

    def contract(self, facts: Facts) -> Contract:
        contract = super().contract(facts)
        contract.runs += self.policy_runs(facts)
        contract.runs += facts.loop_runs(
            f"torch.compile(model) after {self.optimizer_after}", "torch.compile(train_step)"
        )
        contract.runs += facts.batch_runs(f"the loader's batch_size={facts.micro_batch}")
        contract.fill_in = f"{expects(facts)}; the optimizer and scheduler lines."
        return contract

    def policy_runs(self, facts: Facts) -> list[str]:
        """What the code below does for the policy (shared with FSDP2)."""
        runs = []
        if facts.mixed is not None:
            runs.append(f"torch.autocast({DTYPE_SHORT[facts.mixed]}) around forward and loss; fp32 weights.")
        if facts.fp8_recipe:
            runs.append(
                f"torchao.float8 ({facts.fp8_recipe} scales) on every Linear with both dimensions divisible"
                " by 16: e4m3 forward, e5m2 gradients, fp32 accumulation; the rest under bf16 autocast."
            )
            if facts.config.keep_bf16:
                runs.append(
                    f"precision map keep_bf16={py(list(facts.config.keep_bf16))}: those Linear layers stay in"
                    " bf16 under autocast."
                )
        if facts.true is not None:
            runs.append(
                f"{DTYPE_SHORT[facts.true]} weights (no fp32 master copy), {DTYPE_SHORT[facts.true]} inputs"
                f" (a forward pre-hook), {DTYPE_SHORT[facts.true]} default dtype around forward and loss"
                " (tensors that forward creates match the weights)."
            )
        if facts.scaler is not None:
            what = "HalfGradScaler (GradScaler that also unscales fp16 gradients)"
            if facts.true is None:
                what = "torch.amp.GradScaler"
            runs.append(
                f"{what}: unscale before clipping, a non-finite step is skipped with its scheduler step."
            )
        if facts.finite_check:
            runs.append("finite_check: a step with non-finite gradients is skipped.")
        if facts.channels_last:
            runs.append("channels_last weights and 4-D inputs (a forward pre-hook, positional and keyword).")
        if facts.keep:
            runs.append(f"keep_fp32={py(facts.keep)}: fp32 weights, fp32 inputs, outside autocast.")
        return runs

    def third_party(self, facts: Facts) -> list[str]:
        fp8 = ["from torchao.float8 import Float8LinearConfig, convert_to_float8_training"]
        return ["import torch", *(fp8 if facts.fp8_recipe else [])]

    def snippet_names(self, facts: Facts) -> list[str]:
        return helper_names(facts) + loop_helper_names(facts)

    def prepare(self, facts: Facts) -> list[str]:
        return prepare_lines(facts, move=True)

    def monitor(self, facts: Facts) -> list[str]:
        scaler = ", scaler=scaler" if facts.scaler is not None else ""
        return monitor_comment(
            f"monitor = mixprec.Monitor(model{scaler}, optimizer=optimizer, loss_fn=loss_fn)",
            when="before the loop",
            then="monitor.observe(loss, batch) after each step; monitor.save(obj, path) checkpoints",
        )

    def body(self, facts: Facts) -> list[str]:
        blocks = helpers(self.snippet_names(facts))
        return [
            *preamble(facts.device_type, *self.third_party(facts), helpers=blocks),
            *precision_lines(facts),
            *helper_lines(blocks),
            *self.prepare(facts),
            *facts.compile_lines(),
            "",
            *half_state_note(facts),
            facts.optimizer_line(after=self.optimizer_after),
            SCHEDULER,
            *self.training_loop(facts),
        ]

    def training_loop(self, facts: Facts) -> list[str]:
        """The loop after the optimizer and scheduler lines (FSDP2 adds its gradient-sync switch)."""
        return plain_loop(facts)


def half_state_note(facts: Facts) -> list[str]:
    """*-true: the comment above the optimizer line that a stock torch optimizer keeps its state in
    the parameters' half dtype (what lint's MP306 reports)."""
    if facts.true is None:
        return []
    short = DTYPE_SHORT[facts.true]
    lost = {
        "bf16": "0.999 * exp_avg_sq rounds back to exp_avg_sq in bf16: it stops decaying",
        "fp16": "a gradient below 5e-3 adds nothing to exp_avg_sq in fp16: 1e-3 * grad**2 underflows",
    }[short]
    return comment(
        f"{short} parameters: torch.optim.AdamW keeps its state (exp_avg, exp_avg_sq) in {short} too, as"
        f" every stock torch optimizer with state does (SGD's momentum buffer too), and {lost}. For fp32"
        " state keep fp32 master weights (a *-mixed policy) or use an optimizer that keeps fp32 state"
        " for half parameters (mixprec lint: MP306)."
    )


def plain_loop(facts: Facts, sync: list[str] | None = None) -> list[str]:
    """The training loop of the plain-PyTorch and FSDP2 exports; under the step scope its body is a
    ``train_step`` function compiled whole (:func:`step_loop`). With gradient accumulation each
    micro-batch's loss is divided by ``accumulation_steps`` and backpropagated, and clipping, the
    (scaled) optimizer step, the scheduler and zero_grad run once every ``accumulation_steps``
    micro-batches; ``sync``: lines at the top of the loop body (FSDP2's gradient-sync switch)."""
    lines: list[str] = []
    opts = facts.scaler
    if opts is not None:
        cls = "HalfGradScaler" if facts.true == torch.float16 else "torch.amp.GradScaler"
        lines += grad_scaler_lines(facts, cls, "device_type")
    if facts.compiles_step:
        return [*lines, *step_loop(facts)]
    lines += [*accumulation_lines(facts), loop_head(facts), *(sync or []), *loss_lines(facts)]
    added = "  # the micro-batches' gradients add up" if facts.accumulates else ""
    if opts is not None:
        lines += [f"    scaler.scale(loss).backward(){added}", *accumulate_lines(facts)]
        lines += scaled_update_lines(facts, backward=False)
        lines += ["    if not skipped:", "        scheduler.step()  # a skipped step skips the scheduler too"]
    elif facts.finite_check:
        lines += [
            f"    loss.backward(){added}",
            *accumulate_lines(facts),
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
            "    grads = [p.grad for p in model.parameters() if p.grad is not None]",
            "    if all(bool(torch.isfinite(g).all()) for g in grads):  # finite_check: skip inf/NaN steps",
            "        optimizer.step()",
            "        scheduler.step()",
        ]
    else:
        lines += [
            f"    loss.backward(){added}",
            *accumulate_lines(facts),
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
            "    optimizer.step()",
            "    scheduler.step()",
        ]
    lines.append("    optimizer.zero_grad(set_to_none=True)")
    return lines + collapse_note(facts)


def step_loop(
    facts: Facts,
    backward: tuple[str, str] = (
        "    loss.backward()",
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    ),
    autocast: str | None = None,
    skipped_note: str = "  # a skipped step skips the scheduler too",
) -> list[str]:
    """The loop's body as ``train_step``, compiled whole as mixprec measured the step scope; the
    scheduler steps outside it (dynamo skips torch.optim.lr_scheduler) unless the step was skipped,
    which the function returns where a step can be skipped (loss scaling, finite_check).
    ``backward``: the backward and clipping lines, ``autocast``: :func:`loss_lines`'s (Accelerate's
    own); ``skipped_note``: the comment on the scheduler's step after a step that may be skipped."""
    body = ["def train_step(batch):", *loss_lines(facts, autocast=autocast)]
    if facts.scaler is not None:
        body += scaled_update_lines(facts)
    elif facts.finite_check:
        body += [
            *backward,
            "    grads = [p.grad for p in model.parameters() if p.grad is not None]",
            "    skipped = not all(bool(torch.isfinite(g).all()) for g in grads)  # finite_check",
            "    if not skipped:",
            "        optimizer.step()",
        ]
    else:
        body += [*backward, "    optimizer.step()"]
    body.append("    optimizer.zero_grad(set_to_none=True)")
    if facts.scaler is None and not facts.finite_check:
        body.append("    return loss")
        loop = [loop_head(facts), "    loss = train_step(batch)", "    scheduler.step()"]
    else:
        body.append("    return loss, skipped")
        loop = [
            loop_head(facts),
            "    loss, skipped = train_step(batch)",
            "    if not skipped:",
            f"        scheduler.step(){skipped_note}",
        ]
    return ["", "", *body, "", "", *facts.step_compile_lines(), *loop, *collapse_note(facts)]


def scaled_update_lines(facts: Facts, backward: bool = True) -> list[str]:
    """Backward (unless ``backward`` is False: the accumulating loop backpropagates every micro-batch
    before it), clipping and step through the GradScaler, with ``skipped`` set and the min_scale floor."""
    opts = facts.scaler
    assert opts is not None
    lines = [
        *(["    scaler.scale(loss).backward()"] if backward else []),
        "    scaler.unscale_(optimizer)  # before clipping: the threshold is for the true gradients",
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
        "    scale = scaler.get_scale()",
        "    scaler.step(optimizer)  # skipped when the gradients hold inf/NaN",
        "    scaler.update()",
        "    skipped = scaler.get_scale() < scale  # it backs off exactly when it skipped the step",
    ]
    return lines + min_scale_lines(facts)


def min_scale_lines(facts: Facts) -> list[str]:
    """The min_scale floor GradScaler lacks, after its ``update()`` (nothing without a floor)."""
    opts = facts.scaler
    if opts is None or opts.min_scale is None:
        return []
    floor = py(opts.min_scale)
    return [
        f"    if scaler.get_scale() < {floor}:",
        f"        scaler.update({floor})  # min_scale floor: GradScaler has none",
    ]


def collapse_note(facts: Facts) -> list[str]:
    """The note on mixprec's ScaleCollapseError, which plain GradScaler code does not raise."""
    opts = facts.scaler
    if opts is None or opts.min_scale is None:
        return []
    return comment(
        f"mixprec also raises ScaleCollapseError after {opts.max_skips_at_min_scale} overflowing steps"
        " in a row at the floor; add such a check if you want that alarm."
    )
