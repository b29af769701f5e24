"""The ``mixprec`` target: the ``get_policy(...)`` call with exactly the non-default options, and the loop.

Under the step scope the loop's body is ``train_step``, compiled whole as mixprec's own
``TrainingSession`` compiles it: ``policy.autocast()``, ``policy.backward()`` and ``policy.step()``
inside one ``torch.compile``'d function, the scheduler outside it.
"""

from __future__ import annotations

from mixprec.exports.facts import Facts
from mixprec.exports.loop import SCHEDULER, accumulate_lines, accumulation_lines, loop_head
from mixprec.exports.target import Contract, ExportTarget, monitor_comment
from mixprec.exports.text import py

EXPECTS = "model (nn.Module), loader (iterable of batches), loss_fn(model, batch) -> scalar loss"


def expects(facts: Facts, counted: bool = True) -> str:
    """:data:`EXPECTS`, with the batches the loader must yield where the candidate names a micro-batch;
    ``counted``: the loop counts the micro-batches itself, so a pass must hold whole steps (False where
    the stack counts them: Accelerate, DeepSpeed)."""
    m, k = facts.micro_batch, facts.accumulation_steps
    if m is None:
        return EXPECTS
    what = "micro-batches" if facts.accumulates else "batches"
    loader = f"loader (iterable of {what} of {m} samples: DataLoader(..., batch_size={m})"
    if facts.accumulates and counted:
        loader += f", a multiple of {k} per pass: a last partial group's gradients would add to the next step"
    return EXPECTS.replace("loader (iterable of batches)", loader + ")")


class MixprecTarget(ExportTarget):
    """mixprec itself: what was measured and verified, applied by :class:`mixprec.Policy`."""

    name = "mixprec"
    title = "mixprec"
    writes_fp8 = True
    writes_block = True

    def contract(self, facts: Facts) -> Contract:
        return Contract(
            runs=[
                "Policy.prepare(), autocast(), backward() and step(): the policy exactly as mixprec"
                " verified it.",
                *facts.loop_runs("torch.compile(model) after prepare()", "torch.compile(train_step)"),
                *facts.batch_runs(f"the loader's batch_size={facts.micro_batch}"),
            ],
            fill_in=f"{expects(facts)}; the optimizer and scheduler lines.",
        )

    def monitor(self, facts: Facts) -> list[str]:
        return monitor_comment(
            "monitor = mixprec.Monitor(model, policy, optimizer=optimizer, loss_fn=loss_fn, rescue=True)",
            when="before the loop",
            then="monitor.observe(loss, batch) after policy.step(...); monitor.save(obj, path) checkpoints",
        )

    def body(self, facts: Facts) -> list[str]:
        options: dict[str, object] = {}
        if facts.channels_last:
            options["channels_last"] = True
        if facts.keep:
            options["keep_fp32"] = facts.keep
        if facts.config.keep_bf16:
            options["keep_bf16"] = list(facts.config.keep_bf16)
        if facts.config.finite_check:  # kept where a scaler makes it redundant: the call rebuilds the config
            options["finite_check"] = True
        options.update(facts.scaler_changes())
        args = [
            py(facts.name),
            f"device={py(facts.device_type)}",
            *(f"{k}={py(v)}" for k, v in options.items()),
        ]
        call = [f"policy = mixprec.get_policy({', '.join(args)})"]
        if len(call[0]) > 100:
            call = ["policy = mixprec.get_policy(", *(f"    {a}," for a in args), ")"]
        lines = [
            "import torch",
            "",
            "import mixprec",
            "",
            *call,
            "model = policy.prepare(model)  # device, half casts, channels_last, fp32 islands (in place)",
            *facts.compile_lines(),
            facts.optimizer_line(after="prepare()"),
            SCHEDULER,
            *(step_loop(facts) if facts.compiles_step else eager_loop(facts)),
        ]
        if facts.scaler is not None or facts.finite_check:
            lines.append(
                "# policy.stats.as_dict(): steps, skipped_steps, scale history, last non-finite parameters"
            )
        return lines


EAGER_LOOP = [
    "with policy.precision_scope():  # the fp32 math mode (TF32 / bf32 / strict), restored on exit",
    "    for batch in loader:",
    "        with policy.autocast():",
    "            loss = loss_fn(model, batch)",
    "        policy.backward(loss)  # scaled when the policy scales the loss",
    "        if policy.step(optimizer, clip_grad_norm=1.0):  # unscale -> clip -> step -> update",
    "            scheduler.step()  # a skipped (non-finite) step skips the scheduler too",
    "        optimizer.zero_grad(set_to_none=True)",
]


def eager_loop(facts: Facts) -> list[str]:
    """:data:`EAGER_LOOP`; with gradient accumulation each micro-batch's loss divided by
    ``accumulation_steps`` and backward on every one (a scaled loss is scaled by the same factor
    until the step), ``policy.step`` and ``zero_grad`` once every ``accumulation_steps``."""
    if facts.micro_batch is None:
        return EAGER_LOOP
    if not facts.accumulates:
        return [EAGER_LOOP[0], f"    {loop_head(facts)}", *EAGER_LOOP[2:]]
    return [
        *accumulation_lines(facts),
        EAGER_LOOP[0],
        f"    {loop_head(facts)}",
        "        with policy.autocast():",
        "            loss = loss_fn(model, batch) / accumulation_steps"
        "  # the mean over the step's micro-batches",
        "        policy.backward(loss)  # scaled when the policy scales the loss; the gradients add up",
        *accumulate_lines(facts, indent_by=8),
        *EAGER_LOOP[5:],
    ]


def step_loop(facts: Facts) -> list[str]:
    """The loop under the step scope: its body as ``train_step``, compiled whole; the scheduler stays
    outside (dynamo skips torch.optim.lr_scheduler) and hears whether the step was taken."""
    return [
        "",
        "",
        "def train_step(batch):",
        "    with policy.autocast():",
        "        loss = loss_fn(model, batch)",
        "    policy.backward(loss)  # scaled when the policy scales the loss",
        "    stepped = policy.step(optimizer, clip_grad_norm=1.0)  # unscale -> clip -> step -> update",
        "    optimizer.zero_grad(set_to_none=True)",
        "    return loss, stepped",
        "",
        "",
        *facts.step_compile_lines(),
        "with policy.precision_scope():  # the fp32 math mode (TF32 / bf32 / strict), restored on exit",
        f"    {loop_head(facts)}",
        "        loss, stepped = train_step(batch)",
        "        if stepped:",
        "            scheduler.step()  # a skipped (non-finite) step skips the scheduler too",
    ]
