"""One configuration mixprec measures, checks, recommends and exports: a :class:`Candidate`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mixprec import validation
from mixprec.errors import PolicyError, UsageError
from mixprec.policy.registry import PolicySpec, canonical_name, spec_of

# Formats `check` can emulate on hardware without them (mixprec.numerics.emulate).
EMULATABLE: tuple[str, ...] = ("tf32", "bf16", "fp8_e4m3", "fp8_e5m2")
# torch.compile modes; "reduce-overhead" (CUDA graphs) only on CUDA. Other frameworks name their own
# (mixprec.frameworks.Framework.compile_modes: "xla" for Keras on TensorFlow).
# What a torch candidate compiles: the model (torch.compile(model), its forward and the backward
# AOTAutograd derives), or the whole step (forward, loss, backward and the optimizer step in one
# torch.compile'd function: PyTorch's compiled-optimizer recipe on top of the model's graphs).
COMPILE_SCOPES: tuple[str, ...] = ("model", "step")
COMPILE_MODES: tuple[str, ...] = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
# How a torch.optim optimizer applies its update: a Python loop per parameter, multi-tensor
# (foreach) kernels, or one fused kernel (Adam, AdamW, SGD on CPU and CUDA).
OPTIMIZER_IMPLS: tuple[str, ...] = ("for-loop", "foreach", "fused")


@dataclass(frozen=True)
class Candidate:
    """A precision policy plus the modifiers that change what runs. Frozen and hashable: the key
    of every table that maps a configuration to its measurement or verdict.

    Attributes:
        policy: canonical policy name (aliases are resolved on construction).
        channels_last: run 4-D weights and inputs in NHWC memory format.
        keep_fp32: module-name glob patterns that run outside autocast in fp32 ("fp32 islands").
        keep_bf16: low-format Linear policies (fp8, mxfp8, nvfp4): the precision map, Linear names or
            globs whose GEMMs stay in bf16, optionally one direction only ('head:wgrad'); see
            :mod:`mixprec.policy.lowformat`.
        emulate: `check` only: run strict fp32 under this format's emulated rounding
            (one of :data:`EMULATABLE`) to predict hardware the machine lacks.
        compile: the compile mode the step runs under, None for eager: a ``torch.compile`` mode
            (:data:`COMPILE_MODES`) for torch, "xla" for TensorFlow.
        compile_scope: what is compiled, where the framework offers a choice (torch:
            :data:`COMPILE_SCOPES`); None is the framework's default (torch: the model; XLA always
            compiles Keras' whole train step).
        optimizer: the optimizer's implementation (one of :data:`OPTIMIZER_IMPLS`), None for the
            workload's optimizer as written.
        micro_batch: samples per forward/backward pass, where the candidate runs another micro-batch
            than the run's batch (``tune --batch auto``: the largest that fits a memory budget);
            None: the run's batch size.
        accumulation_steps: micro-batches per optimizer step (gradient accumulation), so that
            ``micro_batch * accumulation_steps`` is the run's effective batch; 1 without it.
        framework: the training framework the candidate runs in (a registered
            :class:`mixprec.frameworks.Framework`: "torch", or "tensorflow" for Keras 3). Which axes
            apply is the framework's to say (:meth:`~mixprec.frameworks.Framework.validate`: Keras
            is NHWC already, so no channels_last); a candidate is checked against them where it
            enters bench, check, tune or an export.
        as_written: the source's own precision, untouched (a training script as its author wrote it:
            its own autocast, GradScaler and flags); ``policy`` then names what that precision is
            (detected), so verdicts and peaks apply. Only sources that run unchanged have it
            (:attr:`mixprec.frameworks.Framework.runs_as_written`).
    """

    policy: str
    channels_last: bool = False
    keep_fp32: tuple[str, ...] = ()
    emulate: str | None = None
    compile: str | None = None
    optimizer: str | None = None
    compile_scope: str | None = None
    framework: str = "torch"
    micro_batch: int | None = None
    accumulation_steps: int = 1
    keep_bf16: tuple[str, ...] = ()
    as_written: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", canonical_name(self.policy))
        keep = self.keep_fp32
        if isinstance(keep, str):
            keep = (keep,)
        if not isinstance(keep, (tuple, list)) or not all(isinstance(p, str) and p for p in keep):
            raise PolicyError(
                f"keep_fp32 must be module-name glob patterns, got {self.keep_fp32!r}; valid: a string or a "
                "list of strings, e.g. keep_fp32=['head']."
            )
        object.__setattr__(self, "keep_fp32", tuple(keep))
        from mixprec.policy.lowformat import validate_map

        object.__setattr__(self, "keep_bf16", validate_map(self.spec, self.keep_bf16))
        if not isinstance(self.as_written, bool):
            raise PolicyError(f"as_written must be True or False, got {self.as_written!r}.")
        if not isinstance(self.channels_last, bool):
            raise PolicyError(f"channels_last must be True or False, got {self.channels_last!r}.")
        if self.emulate is not None and self.emulate not in EMULATABLE:
            raise PolicyError(
                f"Cannot emulate {self.emulate!r}; valid: {', '.join(EMULATABLE)}. "
                "fp16 runs natively on every CPU: check fp16-mixed instead."
            )
        if not isinstance(self.framework, str) or not self.framework:
            raise PolicyError(f"framework must be a framework name such as 'torch', got {self.framework!r}.")
        if self.compile is not None and (not isinstance(self.compile, str) or not self.compile):
            raise PolicyError(
                f"compile must be a compile mode such as 'default' (or None: eager), got {self.compile!r}."
            )
        scope = self.compile_scope
        if scope is not None and (self.compile is None or not isinstance(scope, str)):
            raise PolicyError(
                f"compile_scope={self.compile_scope!r} without a compile mode: name one (compile='default') "
                "or drop compile_scope."
            )
        if self.compile_scope == "model":
            object.__setattr__(self, "compile_scope", None)  # the default scope, one spelling
        for name in ("micro_batch", "accumulation_steps"):
            try:
                validation.optional_positive_int(name, getattr(self, name))
            except UsageError as exc:  # a Candidate's fields are the policy's: PolicyError, as above
                raise PolicyError(str(exc)) from None
        if self.accumulation_steps > 1 and self.micro_batch is None:
            raise PolicyError(
                f"accumulation_steps={self.accumulation_steps} without a micro_batch: name the samples "
                "per micro-batch too (micro_batch=16), so the effective batch is micro_batch * "
                "accumulation_steps."
            )
        if self.optimizer is not None and self.optimizer not in OPTIMIZER_IMPLS:
            raise PolicyError(
                f"Unknown optimizer implementation {self.optimizer!r}; valid: {', '.join(OPTIMIZER_IMPLS)} "
                "(or None: as the workload builds it)."
            )

    @property
    def spec(self) -> PolicySpec:
        return spec_of(self.policy)

    @property
    def label(self) -> str:
        """Short human label: 'bf16-mixed+cl+fp32[head]', 'bf16 (emulated)'."""
        if self.emulate:
            return f"{self.emulate} (emulated)"
        islands = f"+fp32[{','.join(self.keep_fp32)}]" if self.keep_fp32 else ""
        if self.keep_bf16:
            islands += f"+bf16[{','.join(self.keep_bf16)}]"
        compiled = ""
        scope = f"-{self.compile_scope}" if self.compile_scope else ""  # +compile-step
        if self.compile == "default":
            compiled = f"+compile{scope}"
        elif self.compile in COMPILE_MODES:
            compiled = f"+compile{scope}:{self.compile}"
        elif self.compile:  # another framework's own mode, e.g. "+xla"
            compiled = f"+{self.compile}"
        optimizer = f"+{self.optimizer}" if self.optimizer else ""
        batch = ""  # '@16x4': micro-batches of 16, four per optimizer step
        if self.micro_batch is not None:
            batch = f"@{self.micro_batch}" + (
                f"x{self.accumulation_steps}" if self.accumulation_steps > 1 else ""
            )
        label = self.policy + ("+cl" if self.channels_last else "") + islands + compiled + optimizer + batch
        return f"{label} (as written)" if self.as_written else label

    @property
    def unbatched(self) -> Candidate:
        """This candidate at the run's batch: without its micro-batch and accumulation."""
        return replace(self, micro_batch=None, accumulation_steps=1)

    @property
    def numerics(self) -> Candidate:
        """The candidate whose numerics verdict applies to this one: the memory layout and the
        optimizer's implementation change which kernels run, not the formats they round to, so they
        share a verdict; a compiled candidate has its own (fused kernels round differently). The
        micro-batch does not change the formats either: a verdict checked at one micro-batch stands
        for the candidate's others (``tune --batch auto`` checks at the micro-batch it measured)."""
        return replace(self, channels_last=False, optimizer=None, micro_batch=None, accumulation_steps=1)

    @property
    def threshold_key(self) -> str:
        return f"emulated:{self.emulate}" if self.emulate else self.policy

    def policy_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`mixprec.get_policy` that reproduce this candidate."""
        options: dict[str, Any] = {}
        if self.channels_last:
            options["channels_last"] = True
        if self.keep_fp32:
            options["keep_fp32"] = list(self.keep_fp32)
        if self.keep_bf16:
            options["keep_bf16"] = list(self.keep_bf16)
        return options

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "channels_last": self.channels_last,
            "keep_fp32": list(self.keep_fp32),
            "keep_bf16": list(self.keep_bf16),
            "emulate": self.emulate,
            "compile": self.compile,
            "compile_scope": self.compile_scope,
            "optimizer": self.optimizer,
            "framework": self.framework,
            "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "as_written": self.as_written,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        if not isinstance(data, dict) or "policy" not in data:
            raise PolicyError(f"A candidate needs at least a 'policy' key, got {data!r}.")
        return cls(
            policy=data["policy"],
            channels_last=bool(data.get("channels_last", False)),
            keep_fp32=tuple(data.get("keep_fp32") or ()),
            keep_bf16=tuple(data.get("keep_bf16") or ()),
            emulate=data.get("emulate"),
            compile=data.get("compile"),
            compile_scope=data.get("compile_scope"),
            optimizer=data.get("optimizer"),
            framework=data.get("framework", "torch"),
            micro_batch=data.get("micro_batch"),
            accumulation_steps=int(data.get("accumulation_steps") or 1),
            as_written=bool(data.get("as_written", False)),
        )


def check_torch_axes(candidate: Candidate) -> None:
    """The rules torch puts on a candidate's loop axes beyond their vocabulary: an emulated format
    runs under strict fp32, eager; the step scope compiles the optimizer's update itself, so it takes
    no optimizer implementation. Raises :class:`PolicyError` naming the clash and the fix."""
    if candidate.emulate is not None and (candidate.policy != "fp32" or candidate.compile):
        raise PolicyError(
            f"An emulated format runs under strict fp32, eager: got {candidate.policy} with "
            f"emulate={candidate.emulate!r}, compile={candidate.compile!r}."
        )
    if candidate.compile_scope == "step" and candidate.optimizer is not None:
        raise PolicyError(
            f"{candidate.label}: the step scope compiles the optimizer's update itself; drop "
            f"optimizer={candidate.optimizer!r} (or compile the model only)."
        )
    if candidate.compile is not None and candidate.compile not in COMPILE_MODES:
        raise PolicyError(
            f"Unknown PyTorch compile mode {candidate.compile!r}; valid: {', '.join(COMPILE_MODES)}."
        )
    if candidate.compile_scope is not None and candidate.compile_scope not in COMPILE_SCOPES:
        raise PolicyError(
            f"Unknown PyTorch compile scope {candidate.compile_scope!r}; valid: {', '.join(COMPILE_SCOPES)}."
        )
