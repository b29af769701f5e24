"""The export target interface: one class per training stack, subclassing :class:`ExportTarget` and
overriding what differs: :meth:`~ExportTarget.refusal` (where the stack cannot express the candidate
faithfully), :meth:`~ExportTarget.contract` (what each setting does, what the stack cannot express
and what the user fills in) and :meth:`~ExportTarget.body` (the code). Every target, the
precision-map family (:mod:`mixprec.exports.maps`) included, raises the one refusal type
(:class:`~mixprec.errors.ExportRefused`) and opens its text with the one header
(:meth:`~ExportTarget.header`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from mixprec.errors import ExportRefused
from mixprec.exports.facts import Facts
from mixprec.exports.text import bullets, comment, join_lines
from mixprec.policy.candidate import Candidate
from mixprec.policy.policy import Policy, PolicyConfig


@dataclass(frozen=True)
class Refusal:
    """Why a target cannot express a candidate faithfully, and what to use instead.

    Attributes:
        reason: why, one clause a user can act on.
        alternative: the nearest faithful alternative (another option, policy or target).
        entry: the precision-map entry or Linear layer a map target cannot express; None where the
            policy, its format or an option is the reason.
    """

    reason: str
    alternative: str
    entry: str | None = None


@dataclass
class Contract:
    """The header of an export: what runs, what the stack cannot express, what the user fills in.

    Attributes:
        runs: what each setting of the stack does on this device, one item each.
        instead: what the stack cannot express and what this export (or the user) does instead.
        fill_in: the names the export expects and everything marked "yours" in it.
        launch: how to run it, when that is not ``python train.py``.
    """

    runs: list[str] = field(default_factory=list)
    instead: list[str] = field(default_factory=list)
    fill_in: str = ""
    launch: str = ""


def step_scope_refusal(facts: Facts, reason: str, model_scope: str) -> Refusal:
    """The refusal of ``compile_scope="step"`` by a stack that cannot compile the whole step (it owns
    the optimizer step, or mixprec has not run the step compiled in it): ``reason`` says why, and
    ``model_scope`` how the stack compiles the model, which it exports faithfully."""
    return Refusal(
        reason,
        f"the same candidate at model scope (compile={facts.compile!r} without compile_scope='step') with"
        f" {model_scope}; or the 'pytorch' or 'mixprec' export, which compile the whole step",
    )


def accumulated_step_refusal(facts: Facts) -> Refusal:
    """The refusal of a step compiled whole (``compile_scope="step"``) over accumulated micro-batches,
    by every target: such a step is a loop over the micro-batches with ``backward()`` inside, and dynamo
    does not resume a graph break inside a loop; it skips the compiled function (``graph break in
    loop``) and runs the step eagerly, only the frames it calls compiled on their own."""
    m, k = facts.micro_batch, facts.accumulation_steps
    return Refusal(
        f"a step compiled whole (compile_scope='step') over {k} accumulated micro-batches is a loop with"
        " backward() inside, and dynamo does not resume a graph break inside a loop: it skips the"
        " compiled function and runs the step eagerly, which is not the compiled step the step scope"
        " stands for",
        f"the same candidate at model scope (compile={facts.compile!r} without compile_scope='step'),"
        f" accumulating {k} micro-batches of {m}; or the step scope at micro_batch={(m or 1) * k} without"
        " accumulation, where that fits in memory",
    )


def monitor_comment(setup: str, *, when: str = "", then: str = "") -> list[str]:
    """:meth:`ExportTarget.monitor`'s comment lines: ``when`` in the loop the precision monitor
    (docs/monitor.md) is set up, its ``setup`` code, and what the loop ``then`` calls."""
    head = "# optional, the precision monitor (docs/monitor.md):" + (f" {when}" if when else "")
    return [head, f"#   {setup}", *([f"# then {then}"] if then else [])]


class ExportTarget:
    """One training stack. Subclasses set the class attributes and override what differs."""

    # The target's name and aliases in the one vocabulary (mixprec.exports.registry), and the stack
    # as the header's first line and a refusal name it.
    name: ClassVar[str]
    title: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    # The PyPI package whose behaviour the export relies on and the releases it was checked against
    # (mixprec's `frameworks` test tier runs every export against them); None: torch only.
    package: ClassVar[str | None] = None
    verified: ClassVar[str] = ""
    # Whether the export converts the model's Linear layers with torchao.float8 (the fp8 policies).
    writes_fp8: ClassVar[bool] = False
    # Whether it runs the block formats (mxfp8, nvfp4) as mixprec checked them, layer for layer.
    writes_block: ClassVar[bool] = False

    def facts(
        self,
        source: Candidate | PolicyConfig | Policy,
        device: str | torch.device | None = None,
        model: nn.Module | None = None,
    ) -> Facts:
        """The facts this target writes from: :meth:`Facts.of`, with what :meth:`read_model` takes
        from ``model``."""
        return self.read_model(Facts.of(source, device), model)

    def read_model(self, facts: Facts, model: nn.Module | None) -> Facts:
        """``facts`` with what this target reads off the user's model: nothing for a training-loop
        target, which takes the model as the code's fill-in (the fsdp2 target counts on it the units
        keep_fp32 adds, a precision-map target resolves its map against it)."""
        return facts

    def checked_against(self) -> str:
        """What the export was checked against, for the header's first line; "" for torch alone."""
        return f"{self.package} {self.verified}" if self.package else ""

    def refusal(self, facts: Facts) -> Refusal | None:
        """None when this target expresses the policy faithfully on the device, else why not."""
        only = facts.spec.device_only
        if only is not None and facts.device_type != only.device_type:
            return Refusal(only.reason, only.alternative)
        if facts.compiles_step and facts.accumulates:
            return accumulated_step_refusal(facts)
        if facts.spec.block_format and not self.writes_block:
            return Refusal(
                f"mixprec's {facts.name} is a per-GEMM precision map run by mixprec's own Linear (torchao's "
                "kernels on Blackwell where they express the map, its emulation elsewhere); the "
                f"{self.title} export has no such path mixprec has checked",
                "the 'mixprec' export, or the precision-map target 'torchao', 'torchtitan', 'megatron' or "
                "'transformer-engine' (export(candidate, target, model=model))",
            )
        if facts.fp8_recipe and not self.writes_fp8:
            return Refusal(
                "mixprec's fp8 policies are torchao.float8 Linear layers under bf16 autocast; the "
                f"{self.title} export has no such path mixprec has checked (Lightning's fp8 is "
                "Transformer Engine, Accelerate's and DeepSpeed's need their own fp8 recipe objects)",
                "the 'mixprec' or 'pytorch' export (they convert the model with torchao), or bf16-mixed here",
            )
        return self.stack_refusal(facts)

    def stack_refusal(self, facts: Facts) -> Refusal | None:
        """What this stack cannot express, asked once the checks every target shares passed."""
        return None

    def contract(self, facts: Facts) -> Contract:
        """What this export promises; the base states the fp32 math mode."""
        return Contract(runs=[f"fp32 math mode: {facts.math_mode()}."])

    def body(self, facts: Facts) -> list[str]:
        """The code (and any other files' sections) after the header."""
        raise NotImplementedError

    def monitor(self, facts: Facts) -> list[str]:
        """Optional comment lines that add the precision monitor (docs/monitor.md) to the loop."""
        return []

    # ---------------------------------------------------------------------- shared by every target
    def export(self, facts: Facts) -> str:
        """The text, or :class:`ExportRefused` when :meth:`refusal` says the target cannot express it."""
        refused = self.refusal(facts)
        if refused is not None:
            raise ExportRefused(
                self.title,
                facts.name,
                facts.device_type,
                refused.reason,
                refused.alternative,
                entry=refused.entry,
            )
        return join_lines([*self.header(facts), *self.body(facts), *self.monitor(facts)])

    def header(self, facts: Facts) -> list[str]:
        """The contract as comment lines: the first line names policy, device and target."""
        contract = self.contract(facts)
        checked = f", checked against {self.checked_against()}" if self.checked_against() else ""
        lines = comment(f"mixprec export: policy {facts.describe()} -> {self.title}{checked}")
        if contract.runs:
            lines.append("# What runs:")
            lines += bullets(contract.runs)
        if contract.instead:
            lines.append(f"# Notes (what {self.title} cannot express, what is done instead):")
            lines += bullets(contract.instead)
        if contract.fill_in:
            lines += comment(f"You fill in: {contract.fill_in}")
        if contract.launch:
            lines += comment(f"Run: {contract.launch}")
        return lines
