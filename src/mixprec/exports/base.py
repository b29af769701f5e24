"""What every export target shares: the facts about a policy config, the target interface, the header
that states the export's contract, and the text helpers.

A target (one module per stack, see :mod:`mixprec.exports`) subclasses :class:`ExportTarget` and
overrides what differs: :meth:`~ExportTarget.refusal` (where the stack cannot express the policy
faithfully), :meth:`~ExportTarget.contract` (what each setting does, what the stack cannot express
and what the user fills in) and :meth:`~ExportTarget.body` (the code).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import torch

from mixprec.errors import ExportRefused, MixprecError, UsageError
from mixprec.exports import snippets
from mixprec.hardware.device import resolve_device
from mixprec.policy.candidate import Candidate, check_torch_axes
from mixprec.policy.policy import Policy, PolicyConfig, get_policy
from mixprec.policy.registry import PolicySpec, canonical_name
from mixprec.policy.scaler import ScalerOptions

SECTION_PREFIX = "# --- "
SECTION_SUFFIX = " ---"
WIDTH = 100  # comment lines wrap here; code stays within ruff's 110

# Which fp32_precision knobs matter on which device: cuBLAS/cuDNN on a GPU, oneDNN on a CPU.
LIBRARIES = {"cuda": ("cuda", "cudnn"), "cpu": ("mkldnn",)}
DTYPE_CODE = {
    torch.bfloat16: "torch.bfloat16",
    torch.float16: "torch.float16",
    torch.float32: "torch.float32",
}
DTYPE_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
SCALER_ARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
# The optimizer keyword that selects each implementation of mixprec.policy.candidate.OPTIMIZER_IMPLS.
OPTIMIZER_FLAGS = {"fused": "fused=True", "foreach": "foreach=True", "for-loop": "foreach=False"}
OPTIMIZER = "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # yours; build it after {after}"
SCHEDULER = "scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)  # yours"


# ------------------------------------------------------------------------------------------ facts
@dataclass(frozen=True)
class Facts:
    """What an export writes, all derived from one PolicySpec: the policy config (policy, device,
    channels_last, keep_fp32, finite_check, scaler options) and the candidate's loop axes.

    Attributes:
        config: the policy's config, its name canonical.
        spec: the policy's :class:`~mixprec.policy.registry.PolicySpec`.
        device_type: "cpu" or "cuda": which fp32-math knobs matter and where the stack runs.
        compile: the ``torch.compile`` mode the model ran under when mixprec measured it (one of
            :data:`mixprec.policy.candidate.COMPILE_MODES`); None: eager.
        optimizer: the optimizer implementation mixprec measured (for-loop, foreach or fused, see
            :data:`OPTIMIZER_FLAGS`); None: the user's optimizer as written.
        compile_scope: what ``compile`` compiled (:data:`mixprec.policy.candidate.COMPILE_SCOPES`):
            None or "model" (``torch.compile(model)``), or "step": forward, loss, backward and the
            optimizer step in one ``torch.compile``'d function, as mixprec's own session runs it. A
            target that cannot compile the whole step refuses it rather than compile the model only:
            the compiled optimizer changes both the speed and the rounding that were measured.
        micro_batch: samples per forward/backward pass the candidate was measured at (``tune --batch
            auto``); None: the user's batch as written, and no accumulation.
        accumulation_steps: micro-batches per optimizer step (gradient accumulation): each micro-batch's
            loss divided by it, the optimizer stepped after the last; 1 without accumulation.
    """

    config: PolicyConfig
    spec: PolicySpec
    device_type: str
    compile: str | None = None
    optimizer: str | None = None
    compile_scope: str | None = None
    micro_batch: int | None = None
    accumulation_steps: int = 1

    @classmethod
    def of(cls, source: Candidate | PolicyConfig | Policy, device: str | torch.device | None = None) -> Facts:
        """The facts of what ``source`` trains, converted once for every target.

        ``source`` is a :class:`~mixprec.Candidate` (policy, channels_last, keep_fp32, compile,
        compile_scope, optimizer, micro_batch, accumulation_steps), on ``device`` (default: mixprec's,
        CUDA when available, else CPU), or a :class:`PolicyConfig` / :class:`Policy`, which also carry
        finite_check and the scaler options, on its own device unless ``device`` is given; those
        export eager, with the optimizer and the batch as written. Raises :class:`UsageError` for
        anything else, a candidate of another framework or an emulated one, loop axes mixprec's torch
        backend refuses (an unknown compile mode or scope, the step scope with an optimizer
        implementation), and a policy or device mixprec does not know.
        """
        compile_mode: str | None = None
        optimizer: str | None = None
        scope: str | None = None
        micro_batch: int | None = None
        accumulation_steps = 1
        if isinstance(source, Candidate):
            config = _candidate_config(source, device)
            compile_mode, optimizer, scope = source.compile, source.optimizer, source.compile_scope
            micro_batch, accumulation_steps = source.micro_batch, source.accumulation_steps
        elif isinstance(source, (PolicyConfig, Policy)):
            config = source.config if isinstance(source, Policy) else source
            if device is not None:
                config = replace(config, device=str(device))
        else:
            raise UsageError(
                f"export() takes a mixprec Candidate, PolicyConfig or Policy, got {type(source).__name__} "
                f"{source!r}; e.g. mixprec.Candidate('bf16-mixed', compile='default', optimizer='fused'), or "
                "a recommendation's .candidate."
            )
        try:
            name = canonical_name(config.name)
        except MixprecError as exc:
            raise UsageError(str(exc)) from exc
        try:
            device_type = torch.device(config.device).type
        except (RuntimeError, TypeError) as exc:
            raise UsageError(
                f"Cannot export for the invalid device {config.device!r} ({exc}); valid: "
                f"{', '.join(LIBRARIES)}, optionally with an index ('cuda:1')."
            ) from exc
        if device_type not in LIBRARIES:
            raise UsageError(
                f"Cannot export for device {config.device!r}; mixprec policies run on {', '.join(LIBRARIES)}."
            )
        config = replace(config, name=name)
        return cls(
            config, config.spec, device_type, compile_mode, optimizer, scope, micro_batch, accumulation_steps
        )

    @property
    def accumulates(self) -> bool:
        """Whether the optimizer steps once every ``accumulation_steps`` (> 1) micro-batches."""
        return self.accumulation_steps > 1

    @property
    def effective_batch(self) -> int | None:
        """Samples per optimizer step (per rank under data parallelism); None: the user's batch."""
        return None if self.micro_batch is None else self.micro_batch * self.accumulation_steps

    def batch_runs(self, batch: str, accumulate: str = "") -> list[str]:
        """The contract's line for the micro-batch and the accumulation, or nothing when the candidate
        names no micro-batch. ``batch`` says where this stack takes the micro-batch (e.g. "DataLoader
        batch_size=16"), ``accumulate`` how it accumulates, where it does that itself."""
        m, k = self.micro_batch, self.accumulation_steps
        if m is None:
            return []
        if k == 1:
            return [
                f"Micro-batch {m} ({batch}): {m} samples per forward/backward pass and per optimizer step."
            ]
        how = accumulate or (
            f"each micro-batch's loss divided by {k}, backward on every micro-batch (the gradients add up),"
            f" the optimizer step{' (and the loss scaler)' if self.scaler is not None else ''} and"
            f" zero_grad once every {k} micro-batches"
        )
        return [
            f"Micro-batch {m} ({batch}), gradient accumulation over {k} micro-batches: an effective batch"
            f" of {m * k} samples per optimizer step (per rank under data parallelism); {how}, so each step"
            f" follows the gradient of the {m * k}-sample mean loss, as mixprec measured it."
        ]

    @property
    def compiles_model(self) -> bool:
        """Whether the model alone is compiled (``torch.compile(model)``, the default scope)."""
        return bool(self.compile) and self.compile_scope != "step"

    @property
    def compiles_step(self) -> bool:
        """Whether the whole training step is one compiled function (``compile_scope="step"``)."""
        return bool(self.compile) and self.compile_scope == "step"

    def compile_lines(self, model: str = "model") -> list[str]:
        """``model = torch.compile(model)`` (with the measured mode), or nothing for eager and for the
        step scope (there the model is compiled as part of the step, see :meth:`step_compile_lines`)."""
        if not self.compiles_model:
            return []
        call = f"{model} = torch.compile({model}{self.compile_mode_arg})"
        return [f"{call}  # measured compiled: the first step compiles"]

    def step_compile_lines(self, step: str = "train_step") -> list[str]:
        """``step = torch.compile(step)`` with the measured mode, under a one-line comment of what
        runs compiled (the contract has the details); nothing unless the step scope was measured."""
        if not self.compiles_step:
            return []
        then = "GradScaler runs eagerly" if self.scaler is not None else "the first step compiles"
        return [
            f"# compiled: forward + loss, their backward, the optimizer step; {then}",
            f"{step} = torch.compile({step}{self.compile_mode_arg})",
        ]

    @property
    def compile_mode_arg(self) -> str:
        """``, mode="..."`` for torch.compile, empty for its default mode."""
        return "" if self.compile in (None, "default") else f", mode={py(self.compile)}"

    @property
    def optimizer_flag(self) -> str:
        """The optimizer keyword that selects the measured implementation (``fused=True``), or ""."""
        return OPTIMIZER_FLAGS[self.optimizer] if self.optimizer else ""

    def optimizer_line(self, after: str) -> str:
        """The optimizer line, with the implementation flag that was measured."""
        flag = f", {self.optimizer_flag}" if self.optimizer else ""
        return OPTIMIZER.replace("lr=1e-3)", f"lr=1e-3{flag})").format(after=after)

    def loop_runs(self, compiled: str, step: str = "torch.compile(train_step)") -> list[str]:
        """The contract's lines for the candidate's loop axes; ``compiled`` says what compiles the
        model in this stack (e.g. "torch.compile(model) after fully_shard"), ``step`` what compiles
        the whole step under the step scope."""
        runs = []
        if self.compiles_model:
            runs.append(
                f"{compiled}, mode {py(self.compile)}: the model compiled as mixprec measured it; the first"
                " steps compile (graph breaks run eagerly)."
            )
        if self.compiles_step:
            runs += [
                f"{step}, mode {py(self.compile)}: the whole step compiled as mixprec measured it"
                " (PyTorch's compiled optimizer on top of the model's graphs): forward and loss with the"
                " backward AOTAutograd derives, and the optimizer step; dynamo runs .backward() and"
                " zero_grad() eagerly between the graphs, and the first steps compile.",
                "The scheduler steps outside the compiled function (dynamo skips"
                " torch.optim.lr_scheduler); its first change of the learning rate recompiles the"
                " optimizer step once, after which dynamo passes the lr in as a dynamic value.",
            ]
            if self.scaler is not None:
                runs.append(
                    "GradScaler's methods (scale, unscale_, step, update) run eagerly, as dynamo does"
                    " not trace torch.amp; the optimizer step that scaler.step() calls is still"
                    " compiled, as a frame of its own."
                )
        if self.optimizer:
            runs.append(
                f"{self.optimizer_flag} on the optimizer: the {self.optimizer} implementation mixprec"
                " measured; keep the flag on yours."
            )
        return runs

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def fp8_recipe(self) -> str | None:
        """The torchao.float8 recipe of an fp8 policy."""
        return self.spec.fp8_recipe

    @property
    def mixed(self) -> torch.dtype | None:
        """The autocast dtype of a *-mixed policy."""
        return self.spec.autocast_dtype

    @property
    def true(self) -> torch.dtype | None:
        """The parameter dtype of a *-true policy."""
        return self.spec.param_dtype

    @property
    def low(self) -> torch.dtype | None:
        """The half dtype the policy computes in; None for fp32, tf32 and bf32."""
        return self.spec.low_precision_dtype

    @property
    def short(self) -> str:
        """bf16 / fp16 / fp32: what matmuls and convolutions compute in."""
        return DTYPE_SHORT[self.spec.compute_dtype]

    @property
    def keep(self) -> list[str]:
        return list(self.config.keep_fp32) if self.low is not None else []

    @property
    def channels_last(self) -> bool:
        return self.config.channels_last

    @property
    def scaler(self) -> ScalerOptions | None:
        if not self.spec.loss_scaling:
            return None
        return self.config.scaler or ScalerOptions()

    @property
    def finite_check(self) -> bool:
        """finite_check that matters: policies with a scaler skip non-finite steps anyway."""
        return self.config.finite_check and self.scaler is None

    @property
    def min_scale(self) -> float | None:
        return None if self.scaler is None else self.scaler.min_scale

    def scaler_changes(self) -> dict[str, object]:
        """Scaler options that differ from mixprec's defaults, in ScalerOptions' field order."""
        if self.scaler is None:
            return {}
        default = ScalerOptions()
        return {
            f.name: getattr(self.scaler, f.name)
            for f in fields(ScalerOptions)
            if getattr(self.scaler, f.name) != getattr(default, f.name)
        }

    def knobs(self) -> list[tuple[str, str, str]]:
        """(backend, op, value) for the fp32_precision knobs that matter on the policy's device."""
        libraries = LIBRARIES[self.device_type]
        return [
            (backend, op, value)
            for (backend, op), value in self.spec.precision.per_knob().items()
            if backend in libraries
        ]

    def math_mode(self) -> str:
        """What the fp32_precision knobs make fp32 matmuls and convolutions do."""
        values = {value for _, _, value in self.knobs()}
        if values == {"tf32"}:
            return "TF32 tensor cores for fp32 matmuls and convolutions (cuBLAS, cuDNN)"
        if values == {"bf16"}:
            return "oneDNN fp32 matmuls and convolutions with bf16 internals (bf32)"
        if self.device_type == "cuda":
            what = "strict IEEE fp32 for fp32 matmuls and convolutions (cuDNN convolutions default to TF32)"
        else:
            what = "strict IEEE fp32 for oneDNN fp32 matmuls and convolutions"
        return what + (", also for the ops autocast keeps in fp32" if self.mixed is not None else "")

    def describe(self) -> str:
        """``'bf16-mixed' on cpu (channels_last, keep_fp32=["head"])``."""
        extras = []
        if self.channels_last:
            extras.append("channels_last")
        if self.keep:
            extras.append(f"keep_fp32={py(self.keep)}")
        if self.config.keep_bf16:
            extras.append(f"keep_bf16={py(list(self.config.keep_bf16))}")
        if self.finite_check:
            extras.append("finite_check")
        extras += [f"{k}={py(v)}" for k, v in self.scaler_changes().items()]
        if self.compile:
            extras.append(f"compile={py(self.compile)}")
        if self.compiles_step:
            extras.append(f"compile_scope={py(self.compile_scope)}")
        if self.optimizer:
            extras.append(f"optimizer={py(self.optimizer)}")
        if self.micro_batch is not None:
            extras.append(f"micro_batch={self.micro_batch}")
        if self.accumulates:
            extras.append(f"accumulation_steps={self.accumulation_steps}")
        return f"{self.name!r} on {self.device_type}" + (f" ({', '.join(extras)})" if extras else "")


def _candidate_config(candidate: Candidate, device: str | torch.device | None) -> PolicyConfig:
    """The policy config of a torch candidate on ``device`` (default: mixprec's)."""
    if candidate.framework != "torch":
        raise UsageError(
            f"Cannot export {candidate.label!r}: it is a {candidate.framework!r} candidate and the export "
            "targets write PyTorch code (valid: framework='torch'); a Keras pick is exported as Keras code "
            "by `mixprec tune --framework tensorflow`."
        )
    if candidate.emulate is not None:
        raise UsageError(
            f"Cannot export {candidate.label!r}: it emulates {candidate.emulate} rounding for `check` and "
            "trains nothing to export; export the policy it stands for, e.g. Candidate('bf16-mixed')."
        )
    try:
        # The loop axes as the torch backend runs them (compile mode and scope, the step scope without
        # an optimizer implementation): what was never measured is not exported either.
        check_torch_axes(candidate)
        # Options checked and defaults filled where every Candidate becomes a Policy; built for the
        # CPU, as exporting for a GPU needs none here, then given the device the export is for.
        config = get_policy(candidate, device="cpu", check=False).config
    except MixprecError as exc:
        raise UsageError(str(exc)) from exc
    return replace(config, device=str(resolve_device(None) if device is None else device))


# ------------------------------------------------------------------------------------------ contract
@dataclass(frozen=True)
class Refusal:
    """Why a target cannot express a policy faithfully, and what to use instead."""

    reason: str
    alternative: str


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


class ExportTarget:
    """One training stack. Subclasses set the class attributes and override what differs."""

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
                "the 'mixprec' export, or the map for torchao, torchtitan, Megatron or Transformer Engine "
                "(mixprec.exports.precision_map.render)",
            )
        if facts.fp8_recipe and not self.writes_fp8:
            return Refusal(
                "mixprec's fp8 policies are torchao.float8 Linear layers under bf16 autocast; the "
                f"{self.title} export has no such path mixprec has checked (Lightning's fp8 is "
                "Transformer Engine, Accelerate's and DeepSpeed's need their own fp8 recipe objects)",
                "the 'mixprec' or 'pytorch' export (they convert the model with torchao), or bf16-mixed here",
            )
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
                self.title, facts.name, facts.device_type, refused.reason, refused.alternative
            )
        return join_lines([*self.header(facts), *self.body(facts), *self.monitor(facts)])

    def header(self, facts: Facts) -> list[str]:
        """The contract as comment lines: the first line names policy, device and target."""
        contract = self.contract(facts)
        checked = f", checked against {self.package} {self.verified}" if self.package else ""
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


# ------------------------------------------------------------------------------------------ text helpers
def py(value: object) -> str:
    """A Python literal for ``value``, with double-quoted strings as ruff format writes them."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(py(v) for v in value) + "]"
    return repr(value)


def comment(text: str, indent: int = 0, width: int = WIDTH) -> list[str]:
    """``text`` as ``# `` comment lines, wrapped at ``width`` columns (indent included)."""
    pad = " " * indent + "# "
    return textwrap.wrap(text, width=width, initial_indent=pad, subsequent_indent=pad, break_on_hyphens=False)


def bullets(items: list[str]) -> list[str]:
    """``items`` as ``#   - `` comment bullets, continuation lines indented under the text."""
    out: list[str] = []
    for item in items:
        out += textwrap.wrap(
            item, width=WIDTH, initial_indent="#   - ", subsequent_indent="#     ", break_on_hyphens=False
        )
    return out


def section(name: str) -> str:
    """The ``# --- <file name> ---`` line that starts a file in a multi-file export."""
    return f"{SECTION_PREFIX}{name}{SECTION_SUFFIX}"


def call_lines(head: str, args: list[str], width: int = 110) -> list[str]:
    """``head(args...)`` laid out as ruff format does: one line if it fits, else the arguments on one
    indented line, else one argument per line with a trailing comma."""
    flat = f"{head}({', '.join(args)})"
    if len(flat) <= width:
        return [flat]
    inner = "    " + ", ".join(args)
    if len(inner) <= width:
        return [f"{head}(", inner, ")"]
    return [f"{head}(", *(f"    {a}," for a in args), ")"]


def indent(lines: list[str], spaces: int) -> list[str]:
    return [" " * spaces + line if line else line for line in lines]


def join_lines(lines: list[str]) -> str:
    """Join lines; at most two blank lines in a row (PEP 8 around definitions), none at the end."""
    out: list[str] = []
    for line in lines:
        if line == "" and out[-2:] == ["", ""]:
            continue
        out.append(line)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def imports(*third_party: str, helpers: Sequence[str] = ()) -> list[str]:
    """Import lines in isort order: the standard library the ``helpers`` blocks need, a blank line,
    the third-party packages."""
    std = snippets.stdlib_imports(list(helpers))
    third = sorted(third_party, key=lambda s: (s.startswith("from "), s.split()[1].lower()))
    return [*std, *([""] if std and third else []), *third]


def helpers(names: list[str]) -> list[str]:
    """The source blocks of the named snippets (and what they call)."""
    return snippets.source(names)


def helper_lines(blocks: list[str]) -> list[str]:
    """Helper blocks with two blank lines around each (PEP 8), or one blank line when there are none."""
    lines: list[str] = []
    for block in blocks:
        lines += ["", "", *block.splitlines()]
    return [*lines, "", ""] if lines else [""]


def precision_lines(facts: Facts, *, indent_by: int = 0, legacy_note: bool = True) -> list[str]:
    """The fp32_precision knob assignments, with the note about the legacy API."""
    text = f"fp32 math mode: {facts.math_mode()}."
    if legacy_note:
        text += (
            " The torch >= 2.9 fp32_precision API: do not also use the legacy allow_tf32 flags or"
            " torch.set_float32_matmul_precision(); once both APIs were used, reading either raises."
        )
    knobs = [f'torch.backends.{b}.{op}.fp32_precision = "{value}"' for b, op, value in facts.knobs()]
    return comment(text, indent_by) + indent(knobs, indent_by)


def grad_scaler_lines(facts: Facts, cls: str, device: str, target: str = "scaler") -> list[str]:
    """``scaler = cls(device, init_scale=..., ...)`` with the policy's four GradScaler options."""
    opts = facts.scaler
    assert opts is not None
    return [
        f"{target} = {cls}(",
        f"    {device},",
        *(f"    {name}={py(getattr(opts, name))}," for name in SCALER_ARGS),
        ")",
    ]


def helper_names(
    facts: Facts, *, casts: bool = True, channels_last_hook: bool = True, batch_norm: bool = True
) -> list[str]:
    """The snippets :func:`prepare_lines` uses for this policy."""
    names = []
    if facts.keep:
        names += ["fp32_islands", "keep_in_fp32"]
    if facts.fp8_recipe and facts.config.keep_bf16:
        names.append("matches_any")
    if facts.true is not None and casts:
        names.append("cast_inputs")
        if batch_norm:
            names.append("keep_batch_norm_fp32")
        if facts.keep:
            names.append("refuse_split_ties")
    if facts.channels_last and channels_last_hook:
        names.append("channels_last_inputs")
    return names


def prepare_lines(
    facts: Facts,
    *,
    move: bool,
    casts: bool = True,
    channels_last: bool = True,
    keep_kwargs: tuple[str, ...] = (),
    batch_norm: bool = True,
) -> list[str]:
    """Model preparation in plain PyTorch, in the order Policy.prepare() applies it.

    ``batch_norm``: keep BatchNorm fp32 after a *-true cast, as Policy.prepare() does (False where
    the stack then gathers every parameter of a group in one dtype: FSDP2's export).
    ``casts``: cast a *-true model and register the input cast (False where the stack does both);
    ``channels_last``: convert the model and its inputs here (False where it must happen later);
    ``keep_kwargs``: keyword inputs the input cast leaves alone (the HF Trainer's ``labels``).
    """
    lines = ["model = model.to(device_type)"] if move else []
    if facts.keep:
        lines.append(f"islands = fp32_islands(model, {py(facts.keep)})  # keep_fp32: module-name patterns")
    if facts.fp8_recipe:
        lines += fp8_lines(facts)
    if facts.true is not None and casts:
        if facts.keep:
            lines.append("refuse_split_ties(model, islands)  # a tied weight: fp32 on both sides or neither")
        lines.append(
            f"model = model.to({DTYPE_CODE[facts.true]})  # {DTYPE_SHORT[facts.true]} weights, no fp32"
            " master copy"
        )
        if facts.keep:
            lines += [
                "for module in islands.values():",
                "    module.float()  # fp32 islands keep fp32 weights",
            ]
        if batch_norm:
            lines.append("keep_batch_norm_fp32(model)  # its weights and running statistics stay fp32")
    if facts.channels_last and channels_last:
        lines.append("model = model.to(memory_format=torch.channels_last)")
    if facts.keep:
        back = f", output_dtype={DTYPE_CODE[facts.true]}" if facts.true is not None else ""
        lines += [
            "for module in islands.values():",
            f"    keep_in_fp32(module, device_type{back})  # outside autocast, fp32 inputs",
        ]
    if facts.true is not None and casts:
        keep = f", keep={tuple(keep_kwargs)!r}".replace("'", '"') if keep_kwargs else ""
        lines.append(
            f"model.register_forward_pre_hook(cast_inputs({DTYPE_CODE[facts.true]}{keep}), with_kwargs=True)"
        )
    if facts.channels_last and channels_last:
        lines.append("model.register_forward_pre_hook(channels_last_inputs, with_kwargs=True)")
    return lines


def fp8_lines(facts: Facts) -> list[str]:
    """torchao's conversion of the Linear layers whose dimensions torch._scaled_mm takes (both
    divisible by 16), fp32 islands and the precision map's layers left out: what Policy.prepare()
    converts."""
    island = []
    if facts.keep:
        island += [
            '    if any(name == k or name.startswith(k + ".") for k in islands):',
            "        return False  # fp32 islands stay fp32",
        ]
    if facts.config.keep_bf16:
        island += [
            f"    if matches_any(name, {py(list(facts.config.keep_bf16))}):",
            "        return False  # the precision map (keep_bf16): stays in bf16 under autocast",
        ]
    return [
        "",
        "",
        "def fp8_eligible(module, name):",
        "    if type(module) is not torch.nn.Linear:",
        "        return False",
        *island,
        "    if module.weight.dtype != torch.float32:",
        "        return False  # a float64 or half Linear keeps computing in its own dtype",
        "    return module.in_features % 16 == 0 and module.out_features % 16 == 0  # torch._scaled_mm",
        "",
        "",
        "convert_to_float8_training(",
        "    model,",
        f"    config=Float8LinearConfig.from_recipe_name({py(facts.fp8_recipe)}),",
        "    module_filter_fn=fp8_eligible,",
        ")  # Linear layers -> torchao Float8Linear: fp8 matmuls with dynamic scales",
    ]


def loss_lines(
    facts: Facts, model: str = "model", autocast: str | None = None, divide: bool = True
) -> list[str]:
    """``loss = loss_fn(model, batch)`` inside the policy's context: autocast for *-mixed, the half
    default dtype for *-true (tensors that forward creates get the weights' dtype), none otherwise.

    ``autocast``: the stack's own autocast context expression, e.g. ``accelerator.autocast()``.
    ``divide``: with gradient accumulation, divide the loss by ``accumulation_steps`` (False where
    the stack's backward divides it itself: Accelerate, DeepSpeed).
    """
    call = f"loss = loss_fn({model}, batch)"
    if facts.accumulates and divide:
        call += " / accumulation_steps  # the mean over the step's micro-batches"
    if facts.mixed is not None:
        ctx = autocast or f"torch.autocast(device_type, dtype={DTYPE_CODE[facts.mixed]})"
        return [f"    with {ctx}:", f"        {call}"]
    if facts.true is not None:
        return [f"    with default_dtype({DTYPE_CODE[facts.true]}):", f"        {call}"]
    return [f"    {call}"]


def accumulation_lines(facts: Facts) -> list[str]:
    """``accumulation_steps = k`` for the loops that count micro-batches themselves; nothing without
    accumulation."""
    if not facts.accumulates:
        return []
    m, k = facts.micro_batch, facts.accumulation_steps
    return [
        f"accumulation_steps = {k}  # micro-batches of {m} per optimizer step:"
        f" {facts.effective_batch} samples"
    ]


def loader_comment(facts: Facts) -> str:
    """The comment on ``for ... in loader:`` that says the batch size the loader must yield."""
    if facts.micro_batch is None:
        return ""
    what = "micro-batches" if facts.accumulates else "batches"
    return f"  # {what} of {facts.micro_batch}: DataLoader(..., batch_size={facts.micro_batch})"


def loop_head(facts: Facts, count: bool = True) -> str:
    """``for batch in loader:``, counting the micro-batches (from 1) where the loop accumulates and
    ``count`` says it counts them itself (False: the stack counts them, Accelerate and DeepSpeed)."""
    counting = facts.accumulates and count
    head = "for i, batch in enumerate(loader, start=1):" if counting else "for batch in loader:"
    return head + loader_comment(facts)


def accumulate_lines(facts: Facts, indent_by: int = 4) -> list[str]:
    """After a micro-batch's backward: on to the next micro-batch unless it completes an optimizer
    step (nothing without accumulation)."""
    if not facts.accumulates:
        return []
    k = facts.accumulation_steps
    return indent(
        ["if i % accumulation_steps:", f"    continue  # the optimizer steps once every {k} micro-batches"],
        indent_by,
    )


def loop_helper_names(facts: Facts) -> list[str]:
    """The snippets :func:`loss_lines` and the loss scaling need."""
    names = ["default_dtype"] if facts.true is not None else []
    if facts.true == torch.float16:
        names.append("HalfGradScaler")
    return names
