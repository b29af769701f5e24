"""The Policy object: applies one precision policy to a training loop."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from mixprec import state
from mixprec.errors import (
    PolicyError,
    UnsupportedError,
    did_you_mean,
)
from mixprec.hardware.device import DeviceInfo, detect, resolve_device
from mixprec.policy import lowformat, stepping
from mixprec.policy.candidate import Candidate
from mixprec.policy.hooks import (
    cast_inputs,
    channels_last_inputs,
    default_dtype,
    keep_batch_norm_fp32,
    keep_in_fp32,
    refuse_split_ties,
)
from mixprec.policy.lowformat import LayerPlan
from mixprec.policy.registry import POLICIES, PolicySpec, canonical_name
from mixprec.policy.scaler import (
    ScalerOptions,
    StepStats,
    _GradScaler,
    scaler_state_problem,
)
from mixprec.policy.support import Support, check_support

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PolicyConfig:
    """Everything that defines a policy instance; serialisable, comparable, hashable."""

    name: str
    device: str
    channels_last: bool = False
    keep_fp32: tuple[str, ...] = ()
    finite_check: bool = False
    scaler: ScalerOptions | None = None
    keep_bf16: tuple[str, ...] = ()
    """Low-format Linear policies: the precision map, the Linear GEMMs kept in bf16
    (:mod:`mixprec.policy.lowformat`)."""

    @property
    def spec(self) -> PolicySpec:
        return POLICIES[self.name]

    @property
    def label(self) -> str:
        """Human label used in tables: 'bf16-mixed+cl' for channels_last."""
        return self.name + ("+cl" if self.channels_last else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device,
            "channels_last": self.channels_last,
            "keep_fp32": list(self.keep_fp32),
            "keep_bf16": list(self.keep_bf16),
            "finite_check": self.finite_check,
            "scaler": None if self.scaler is None else vars(self.scaler).copy(),
        }


def _as_optimizers(optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> list:
    if isinstance(optimizers, torch.optim.Optimizer):
        opts = [optimizers]
    elif isinstance(optimizers, (list, tuple)):
        opts = list(optimizers)
    else:
        opts = []
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise PolicyError(f"step() takes a torch.optim.Optimizer or a list of them, got {optimizers!r}.")
    return opts


def widen_to_fp32(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], half: torch.dtype) -> int:
    """Widen ``model``'s parameters (and their gradients), buffers and ``optimizers``' state held in
    the ``half`` dtype to fp32, in place: exact, and the optimizers keep the same parameter objects.
    Returns how many parameters were widened."""
    widened = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == half:
                p.data = p.data.float()
                if p.grad is not None:
                    p.grad = p.grad.float()
                widened += 1
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.dtype == half:
                    module._buffers[key] = buffer.float()
        for optimizer in optimizers:
            for param_state in optimizer.state.values():
                for key, value in param_state.items():
                    if isinstance(value, torch.Tensor) and value.dtype == half:
                        param_state[key] = value.float()
    return widened


class Policy:
    """A precision policy bound to one device. Build it with :func:`mixprec.get_policy`.

    One Policy serves one training loop (one model, one or several optimizers stepped
    together). A policy that needs nothing for a hook does nothing there.
    """

    def __init__(self, config: PolicyConfig) -> None:
        if config.spec.loss_scaling and config.scaler is None:
            # One place that fills the defaults, so a hand-built config keeps the min_scale floor.
            config = replace(config, scaler=ScalerOptions())
        self.config = config
        self.spec = config.spec
        self.device = torch.device(config.device)
        self._scaler: _GradScaler | None = None
        if self.spec.loss_scaling:
            self._scaler = _GradScaler(
                self.device.type,
                config.scaler,  # type: ignore[arg-type]
                allow_fp16_grads=self.spec.param_dtype is not None,
            )
        self.stats = StepStats()
        self.param_names: dict[int, str] = {}
        self.fp8_layers: list[str] = []  # low-format policies: the Linear layers prepare() converted
        self.layer_plan: LayerPlan | None = None  # low-format policies: which GEMMs run in the format
        self._input_cast: Any = None  # *-true: the hook casting the model's inputs to the half dtype

    # ------------------------------------------------------------------ description
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls and convolutions run in (fp32 for fp32/tf32/bf32)."""
        return self.spec.compute_dtype

    @property
    def scaler(self) -> _GradScaler | None:
        return self._scaler

    def check_support(self, info: DeviceInfo | None = None) -> Support:
        """Supported / reason / suggestion for this policy on its device; never raises."""
        return check_support(self.name, info or detect(self.device))

    def __repr__(self) -> str:
        return f"Policy({self.config.label!r}, device={self.config.device!r})"

    # ------------------------------------------------------------------ model
    def prepare(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device and apply casts, channels_last and fp32 islands, in place
        (low-format policies: convert its eligible Linear layers as the precision map says)."""
        if not isinstance(model, nn.Module):
            raise PolicyError(
                f"prepare() takes a torch.nn.Module, got {type(model).__name__}; "
                "pass the model itself (not its parameters or state_dict)."
            )
        earlier = getattr(model, "_mixprec_prepared", None)
        if earlier is not None:
            raise PolicyError(
                f"this model was prepared under {earlier!r} already: its input casts, fp32 islands and "
                "dtypes are on it (a copy.deepcopy keeps them too), and a second policy would stack on "
                "them; prepare a model no policy has prepared: keep an unprepared copy for each policy."
            )
        if self.spec.param_dtype is None:
            half = [n for n, p in model.named_parameters() if p.dtype in _HALF_DTYPES]
            if half:
                raise PolicyError(
                    f"Policy {self.name!r} keeps fp32 master weights but parameter {half[0]!r} is "
                    f"{dict(model.named_parameters())[half[0]].dtype} ({len(half)} half-precision "
                    "parameters in all); call model.float() first, or use a *-true policy."
                )
        islands = self._keep_fp32_modules(model)
        if self.spec.param_dtype is not None:
            try:
                refuse_split_ties(model, islands)
            except ValueError as exc:
                raise PolicyError(str(exc)) from None
        model.to(self.device)
        if self.spec.low_format is not None:
            # the block formats' real kernels where the device has them (Blackwell), else the emulation
            kernel = "AUTO" if self.spec.block_format and self.check_support().native else None
            self.layer_plan = lowformat.convert(
                model, self.spec, self.config.keep_fp32, self.config.keep_bf16, kernel=kernel
            )
            self.fp8_layers = list(self.layer_plan.low)
        if self.spec.param_dtype is not None:
            stored = self.spec.param_dtype
            # floating-point tensors only, as Module.half() does: complex and integer ones keep
            # their dtype (a complex weight cast to a real one would lose its imaginary part)
            model._apply(lambda t: t.to(stored) if t.is_floating_point() else t)
            for module in islands.values():
                module.float()
            keep_batch_norm_fp32(model)
        if self.config.channels_last:
            model.to(memory_format=torch.channels_last)
        for module in islands.values():
            self._wrap_fp32_island(module)
        if self.spec.param_dtype is not None:
            self._input_cast = model.register_forward_pre_hook(
                cast_inputs(self.spec.param_dtype), with_kwargs=True
            )
        if self.config.channels_last:
            model.register_forward_pre_hook(channels_last_inputs, with_kwargs=True)
        self.refresh_param_names(model)
        model._mixprec_prepared = self.config.label  # type: ignore[assignment]
        return model

    def refresh_param_names(self, model: nn.Module) -> None:
        """Re-read parameter names for skip reports after a wrapper replaced the parameters
        (FSDP2's fully_shard does; DDP does not)."""
        self.param_names = {id(p): n for n, p in model.named_parameters()}

    def _keep_fp32_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        named = dict(model.named_modules())
        found: dict[str, nn.Module] = {}
        for pattern in self.config.keep_fp32:
            hits = {n: m for n, m in named.items() if n and fnmatch.fnmatchcase(n, pattern)}
            if not hits:
                some = ", ".join(n for n in list(named)[1:9])
                raise PolicyError(
                    f"keep_fp32 pattern {pattern!r} matches no module of {type(model).__name__}; "
                    f"module names look like: {some}, ...{did_you_mean(pattern, [n for n in named if n])}"
                )
            found.update(hits)
        # Nested matches: wrapping the outer module is enough, and wrapping twice is harmless.
        return found

    def _wrap_fp32_island(self, module: nn.Module) -> None:
        """Run ``module`` outside autocast with fp32 inputs (and cast back for *-true models)."""
        keep_in_fp32(module, self.device.type, output_dtype=self.spec.param_dtype)
        module._mixprec_fp32_island = True  # type: ignore[assignment]

    # ------------------------------------------------------------------ changes during a run
    def keep_fp32_now(self, model: nn.Module, names: Sequence[str]) -> list[str]:
        """Make the modules named ``names`` fp32 islands of a prepared, training ``model`` (what
        ``keep_fp32`` does at prepare time); returns the names that were not islands already. Only
        for policies whose weights are fp32 (*-mixed, fp32 math modes): the optimizer's state and
        the weights need no cast, so the change is exact and takes effect at the next forward."""
        if self.spec.param_dtype is not None:
            raise PolicyError(
                f"keep_fp32_now() under {self.name!r}: its weights are {self.spec.param_dtype}, and "
                "casting them (and the optimizer state) mid-run is not exact; restart with "
                "keep_fp32 in get_policy(), or use a *-mixed policy."
            )
        modules = dict(model.named_modules())
        unknown = [n for n in names if n not in modules]
        if unknown:
            raise PolicyError(
                f"keep_fp32_now(): no module named {unknown[0]!r}{did_you_mean(unknown[0], list(modules))}"
            )
        added = [n for n in names if not getattr(modules[n], "_fp32_island", False)]
        for name in added:
            self._wrap_fp32_island(modules[name])
        self.config = replace(self.config, keep_fp32=(*self.config.keep_fp32, *added))
        return added

    def switch(
        self,
        name: str,
        model: nn.Module | None = None,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        """Continue the run under policy ``name``, in place, to a policy with fp32 weights (*-mixed,
        fp32, tf32, bf32). From another such policy (fp16-mixed -> bf16-mixed, bf16-mixed -> fp32)
        the weights and the optimizer state carry over unchanged. From a *-true policy the half
        weights, buffers and optimizer state of ``model`` and ``optimizers`` are widened to fp32 in
        place (exact: every half value is an fp32 value; the optimizers keep the same parameters)
        and become the master weights, so updates below half a ulp of the half format count again.
        A scaler the new policy does not need is retired (its step count and skips stay in
        :attr:`stats`), one it needs starts fresh (or carries on, from fp16-true to fp16-mixed)."""
        if name not in POLICIES:
            raise PolicyError(f"switch(): unknown policy {name!r}{did_you_mean(name, list(POLICIES))}")
        target = POLICIES[name]
        if target.param_dtype is not None or target.low_format:
            raise PolicyError(
                f"switch() from {self.name!r} to {name!r}: only to policies with fp32 weights "
                "(*-mixed, fp32, tf32, bf32); narrowing weights and optimizer state mid-run is not exact."
            )
        if self.spec.param_dtype is not None:
            if model is None:
                raise PolicyError(
                    f"switch() from {self.name!r} to {name!r} widens the half weights to fp32: pass the "
                    "model and its optimizers, switch(name, model, optimizer)."
                )
            self._widen(model, _as_optimizers(optimizers) if optimizers else [])
        config = replace(self.config, name=name, scaler=self.config.scaler if target.loss_scaling else None)
        if target.loss_scaling and config.scaler is None:
            config = replace(config, scaler=ScalerOptions())
        self.config, self.spec = config, target
        if not target.loss_scaling:
            self._scaler = None
        elif self._scaler is None:
            self._scaler = _GradScaler(self.device.type, config.scaler, allow_fp16_grads=False)  # type: ignore[arg-type]

    def _widen(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """*-true -> fp32 master weights: parameters, gradients, buffers and optimizer state of the
        half dtype to fp32 in place; the input cast removed; fp32 islands no longer cast back."""
        widen_to_fp32(model, optimizers, self.spec.param_dtype)  # type: ignore[arg-type]
        if self._input_cast is not None:
            self._input_cast.remove()
            self._input_cast = None
        for module in model.modules():
            if getattr(module, "_mixprec_fp32_island", False):
                module.forward = module.forward.__wrapped__  # type: ignore[attr-defined]
                del module._fp32_island
                keep_in_fp32(module, self.device.type)  # its outputs stay fp32, as under *-mixed

    # ------------------------------------------------------------------ contexts
    def precision_scope(self) -> contextlib.AbstractContextManager[None]:
        """Set the fp32 math mode (TF32 / bf32 / strict) for the body; restored on exit and on errors."""
        return state.precision_settings(self.spec.precision)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for *-mixed, the half default dtype for *-true, nothing for fp32-storage policies."""
        if self.spec.autocast_dtype is not None:
            return torch.autocast(self.device.type, dtype=self.spec.autocast_dtype)
        if self.spec.param_dtype is not None:
            return default_dtype(self.spec.param_dtype)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ training step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled when this policy uses loss scaling."""
        if self._scaler is not None:
            self._scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def step(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
    ) -> bool:
        """Unscale -> (skip if non-finite) -> clip -> step -> update the scale.

        Returns True when every optimizer stepped, False when the step was skipped because
        gradients were non-finite; skip the LR scheduler step too when it returns False.
        Several optimizers are stepped together and share one scale update, like GradScaler.

        The sequence is GradScaler's recipe, so the weights come out bitwise as a loop written
        with it: with clipping, ``unscale_`` first; without, ``GradScaler.step`` unscales
        (fused optimizers inside their own kernel). Returning a bool needs the host to know
        whether gradients were finite: GradScaler reads exactly that anyway for non-fused
        optimizers, so no synchronisation is added; for fused optimizers it costs one.
        """
        opts = _as_optimizers(optimizer)
        found = self.step_optimizers(opts, clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value)
        return self.end_step(opts, found)

    def step_optimizers(
        self,
        opts: list[torch.optim.Optimizer],
        *,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
    ) -> list[bool]:
        """The first half of :meth:`step` (:func:`mixprec.policy.stepping.step_optimizers`)."""
        return stepping.step_optimizers(
            self, opts, clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value
        )

    def end_step(
        self, opts: Sequence[torch.optim.Optimizer], found_host: Sequence[bool], *, update: bool = True
    ) -> bool:
        """The second half of :meth:`step` (:func:`mixprec.policy.stepping.end_step`)."""
        return stepping.end_step(self, opts, found_host, update=update)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.config.to_dict(),
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned. Everything is validated first (the policy's name,
        the scaler's and the statistics' keys, types and ranges), then loaded: a bad checkpoint
        raises :class:`PolicyError` and leaves this policy as it was."""
        if not isinstance(state_dict, dict):
            raise PolicyError(
                f"load_state_dict() takes the dict Policy.state_dict() returned, got "
                f"{type(state_dict).__name__}; pass checkpoint['policy'] as saved."
            )
        config = state_dict.get("policy")
        saved = config.get("name") if isinstance(config, dict) else None
        if saved != self.name:
            raise PolicyError(
                f"Checkpoint was written by policy {saved!r}, this policy is {self.name!r}; "
                f"build the policy with get_policy({saved!r}) to resume it."
                if isinstance(saved, str)
                else f"Invalid policy state: 'policy' must be the dict with the policy's 'name' "
                f"({self.name!r}), got {config!r}; pass the dict Policy.state_dict() returned."
            )
        scaler_state = state_dict.get("scaler")
        problem = ""
        if self._scaler is not None and scaler_state:
            problem = scaler_state_problem(scaler_state)
        problem = problem or StepStats.state_problem(state_dict.get("stats"))
        if problem:
            raise PolicyError(f"Invalid policy state: {problem}; nothing was loaded.")
        if self._scaler is not None and scaler_state:
            self._scaler.load_state_dict(scaler_state)
        self.stats.load_state_dict(state_dict["stats"])


_SCALER_OPTION_NAMES = tuple(f.name for f in fields(ScalerOptions))
_OPTION_NAMES = ("channels_last", "keep_fp32", "keep_bf16", "finite_check", *_SCALER_OPTION_NAMES)


def get_policy(
    name: str | Candidate,
    *,
    device: str | torch.device | None = None,
    check: bool = True,
    **options: Any,
) -> Policy:
    """Build a :class:`Policy` by name (or alias) for ``device`` (default: CUDA if available, else CPU).

    ``name`` may be a :class:`~mixprec.Candidate`: its policy, channels_last and keep_fp32 (the one
    place a Candidate becomes a Policy; its compile mode and optimizer implementation are the
    training loop's, not the policy's). ``options`` then add to the candidate's own.

    Options: ``channels_last``, ``keep_fp32`` (module-name glob patterns run outside autocast
    in fp32), ``finite_check`` (skip steps with non-finite gradients on policies without a
    scaler) and, for fp16 policies, ``init_scale, growth_factor, backoff_factor,
    growth_interval, min_scale, max_skips_at_min_scale``. Raises :class:`UnsupportedError`
    when the policy cannot run on the device (``check=False`` builds it anyway).
    """
    if isinstance(name, Candidate):
        if name.framework != "torch":
            raise PolicyError(
                f"{name.label} is a {name.framework} candidate; get_policy builds torch policies "
                "(its framework backend builds its own)."
            )
        clash = sorted(set(options) & set(name.policy_options()))
        if clash:
            raise PolicyError(
                f"{clash[0]} was given both by the candidate {name.label!r} and as an option; pass it once."
            )
        options = {**name.policy_options(), **options}
        name = name.policy
    canonical = canonical_name(name)
    spec = POLICIES[canonical]
    dev = resolve_device(device)
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise PolicyError(
            f"Unknown policy option {unknown[0]!r}; valid: {', '.join(_OPTION_NAMES)}."
            f"{did_you_mean(unknown[0], _OPTION_NAMES)}"
        )
    scaler_given = {k: options[k] for k in _SCALER_OPTION_NAMES if k in options}
    if scaler_given and not spec.loss_scaling:
        raise PolicyError(
            f"Loss-scaler option(s) {', '.join(scaler_given)} given for {canonical!r}, which does "
            "not scale the loss; they apply to fp16-mixed and fp16-true only."
        )
    scaler = None
    if spec.loss_scaling:
        scaler = replace(ScalerOptions(), **scaler_given)
        scaler.validate()
    keep = options.get("keep_fp32", ())
    if isinstance(keep, str):
        keep = (keep,)
    if not isinstance(keep, (list, tuple)) or not all(isinstance(p, str) and p for p in keep):
        raise PolicyError(f"keep_fp32 must be a list of module-name patterns (strings), got {keep!r}.")
    if keep and spec.is_math_mode:
        raise PolicyError(
            f"keep_fp32 has no effect under {canonical!r}, which already stores and computes in "
            "fp32; it applies to the *-mixed and *-true policies."
        )
    for flag in ("channels_last", "finite_check"):
        if not isinstance(options.get(flag, False), bool):
            raise PolicyError(f"{flag} must be True or False, got {options[flag]!r}.")
    config = PolicyConfig(
        name=canonical,
        device=str(dev),
        channels_last=options.get("channels_last", False),
        keep_fp32=tuple(keep),
        finite_check=options.get("finite_check", False),
        scaler=scaler,
        keep_bf16=lowformat.validate_map(spec, options.get("keep_bf16", ())),
    )
    policy = Policy(config)
    if check:
        support = policy.check_support()
        if not support:
            hint = f"; try {support.suggestion}" if support.suggestion else ""
            raise UnsupportedError(f"Policy {canonical!r} is not supported on {dev}: {support.reason}{hint}.")
    return policy


def policy_from_config(config: PolicyConfig | dict[str, Any]) -> Policy:
    """Rebuild a policy from :meth:`PolicyConfig.to_dict` output (e.g. read back from JSON)."""
    if isinstance(config, PolicyConfig):
        config = config.to_dict()
    options: dict[str, Any] = {
        "channels_last": config.get("channels_last", False),
        "keep_fp32": list(config.get("keep_fp32", [])),
        "keep_bf16": list(config.get("keep_bf16", [])),
        "finite_check": config.get("finite_check", False),
    }
    if config.get("scaler"):
        options.update(config["scaler"])
    return get_policy(config["name"], device=config["device"], **options)
