"""The facts an export writes: one policy config (policy, device, channels_last, keep_fp32, keep_bf16,
finite_check, the scaler options) and the candidate's loop axes, converted once from a
:class:`~mixprec.Candidate`, :class:`PolicyConfig` or :class:`Policy` for every target; for the
precision-map targets also the map resolved against the model."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from mixprec.errors import MixprecError, UsageError
from mixprec.exports.text import DTYPE_SHORT, py
from mixprec.hardware.device import resolve_device
from mixprec.policy.candidate import Candidate, check_torch_axes
from mixprec.policy.policy import Policy, PolicyConfig, get_policy
from mixprec.policy.registry import PolicySpec, canonical_name
from mixprec.policy.scaler import ScalerOptions

if TYPE_CHECKING:
    from mixprec.exports.maps.resolve import ResolvedMap

# Which fp32_precision knobs matter on which device: cuBLAS/cuDNN on a GPU, oneDNN on a CPU.
LIBRARIES = {"cuda": ("cuda", "cudnn"), "cpu": ("mkldnn",)}
# The optimizer keyword that selects each implementation of mixprec.policy.candidate.OPTIMIZER_IMPLS.
OPTIMIZER_FLAGS = {"fused": "fused=True", "foreach": "foreach=True", "for-loop": "foreach=False"}
OPTIMIZER = "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # yours; build it after {after}"


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
        precision_map: a low-format policy's precision map (``keep_bf16``) resolved against the model's
            Linear layers, for the precision-map targets (:mod:`mixprec.exports.maps`), which take the
            model; None for the targets that write a training loop around the user's model.
        keep_fp32_units: the ``fully_shard`` units the keep_fp32 set adds to FSDP2's plan, counted on
            the model by the fsdp2 target when it is given one
            (:func:`mixprec.distributed.fsdp2.keep_fp32_units`); None: not counted.
    """

    config: PolicyConfig
    spec: PolicySpec
    device_type: str
    compile: str | None = None
    optimizer: str | None = None
    compile_scope: str | None = None
    micro_batch: int | None = None
    accumulation_steps: int = 1
    precision_map: ResolvedMap | None = None
    keep_fp32_units: int | None = None

    @classmethod
    def of(cls, source: Candidate | PolicyConfig | Policy, device: str | torch.device | None = None) -> Facts:
        """The facts of what ``source`` trains, converted once for every target: ``source``,
        ``device`` and the UsageErrors are :func:`mixprec.exports.export`'s (a candidate of another
        framework or an emulated one, or loop axes mixprec's torch backend refuses, raise too)."""
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
