"""Carry a precision policy over to DDP and FSDP2 (``fully_shard``), using torch.distributed as it is.

mixprec builds no distributed runtime of its own. This module answers, for every policy, what
DistributedDataParallel and FSDP2 need (autocast and loss scaling per rank, the gradient
reduce dtype, FSDP2's ``MixedPrecisionPolicy``, fp32 islands sharded with an fp32 policy of
their own), applies it, and checks that every rank made the same skip decisions.

Facts this relies on, checked against torch 2.14 (see docs/distributed.md for how):

- DDP all-reduces (averages) gradients before ``policy.step()``, so an inf/NaN gradient on one
  rank reaches every rank and every rank's scaler (or finite check) skips the same step.
- FSDP2 gradients are DTensor shards. The policy's plain ``torch.amp.GradScaler`` works on
  them: DTensor runs ``_amp_foreach_non_finite_check_and_unscale_`` through a handler that
  all-reduces ``found_inf`` (max) over the mesh, so a non-finite value in any rank's shard skips
  the step on every rank. ``ShardedGradScaler`` is not needed for that.
- gloo all-reduces fp16 and bf16 tensors, and DDP's ``fp16_compress_hook`` and
  ``bf16_compress_hook`` run on it (CPU tensors), so gradient compression is not refused there.

Usage (under ``torchrun``, after ``dist.init_process_group``)::

    policy = mixprec.get_policy("bf16-mixed", device=f"cuda:{local_rank}")
    model = policy.prepare(model)
    model = shard_model(model, policy)          # or: model = apply_ddp(model, policy)
    ...                                         # the usual policy.autocast / backward / step loop
    assert_stats_agree(policy)                  # every rank skipped the same steps
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from mixprec.errors import MixprecError, PolicyError, UnsupportedError, UsageError, did_you_mean
from mixprec.policy.policy import Policy, island_names
from mixprec.policy.registry import POLICIES, PolicySpec, canonical_name
from mixprec.policy.support import Support

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "WRAPPERS",
    "DDPConfig",
    "ShardGroup",
    "StatsMismatchError",
    "apply_ddp",
    "assert_stats_agree",
    "ddp_config",
    "find_blocks",
    "fsdp_mp_policy",
    "shard_model",
    "sharding_plan",
    "support",
]

WRAPPERS: tuple[str, ...] = ("ddp", "fsdp2")
Wrapper = Literal["ddp", "fsdp2"]

_FP32_STORAGE = ("fp32", "tf32", "bf32")
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_COMPRESS_ALIASES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_HOOKS = {
    torch.float16: "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
    torch.bfloat16: "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook",
}
# Backends on which mixprec has run the wrappers (gloo: CPU tensors; nccl: CUDA tensors).
_VERIFIED_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


class StatsMismatchError(MixprecError, RuntimeError):
    """Ranks disagree on steps, skipped steps or the loss scale: their weights have diverged."""

    exit_code = 4

    def __init__(self, message: str, per_rank: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.per_rank = per_rank


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _spec_of(policy: Policy | str) -> PolicySpec:
    if isinstance(policy, Policy):
        return policy.spec
    if isinstance(policy, str):
        return POLICIES[canonical_name(policy)]
    raise PolicyError(f"Expected a mixprec Policy or a policy name, got {type(policy).__name__} {policy!r}.")


def _check_wrapper(wrapper: str) -> str:
    key = wrapper.strip().lower() if isinstance(wrapper, str) else wrapper
    aliases = {"fsdp": "fsdp2", "fully_shard": "fsdp2", "distributeddataparallel": "ddp"}
    key = aliases.get(key, key)
    if key not in WRAPPERS:
        raise PolicyError(
            f"Unknown wrapper {wrapper!r}; valid: {', '.join(WRAPPERS)}."
            f"{did_you_mean(str(wrapper), WRAPPERS)}"
        )
    return key


def _default_backend(policy: Policy | str) -> str | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    if isinstance(policy, Policy):
        return "nccl" if policy.device.type == "cuda" else "gloo"
    return None


def _fsdp():
    """(fully_shard, MixedPrecisionPolicy, FSDPModule): public since torch 2.6, _composable before."""
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )
    return fully_shard, MixedPrecisionPolicy, FSDPModule


def _dtensor_syncs_found_inf() -> bool:
    """True when DTensor all-reduces found_inf inside GradScaler's unscale kernel (torch >= ~2.5)."""
    try:
        from torch.distributed.tensor import DTensor

        handlers = DTensor._op_dispatcher._custom_op_handlers
    except (ImportError, AttributeError):
        return False
    return torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default in handlers


def _nccl_version() -> tuple[int, ...] | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return tuple(version) if isinstance(version, tuple) else None


# ---------------------------------------------------------------------------------------- support
def _backend_support(policy: Policy | str, backend: str | None) -> Support | None:
    """None when the backend is fine for the policy's device; else a Support saying why not or how well."""
    if backend is None or not isinstance(policy, Policy):
        return None
    device = policy.device.type
    if backend == "nccl" and device != "cuda":
        return Support(
            False,
            f"the nccl backend only communicates CUDA tensors and the policy's device is {device}",
            "backend='gloo' (or a policy on device='cuda:<local_rank>')",
        )
    verified = _VERIFIED_BACKEND_DEVICE.get(backend)
    if verified != device:
        return Support(
            True,
            f"{backend} with {device} tensors is not verified by mixprec (verified: gloo with cpu, nccl "
            "with cuda)" + ("; nccl is the fast path on GPUs" if device == "cuda" else ""),
        )
    return None


_DDP_REASONS = {
    "fp32": "fp32 params and fp32 gradient all-reduce; strict fp32 math is set per rank by precision_scope()",
    "tf32": "fp32 params and fp32 gradient all-reduce; TF32 math is set per rank by precision_scope()",
    "bf32": "fp32 params and fp32 gradient all-reduce; oneDNN bf16 math is set per rank by precision_scope()",
    "bf16-mixed": (
        "autocast(bf16) per rank; params and the gradient all-reduce stay fp32; with finite_check=True "
        "every rank skips together because the all-reduce spreads inf/NaN to all ranks"
    ),
    "fp16-mixed": (
        "autocast(fp16) and the policy's GradScaler per rank; params and the gradient all-reduce stay "
        "fp32; the all-reduce spreads inf/NaN to all ranks, so every scaler skips and backs off together"
    ),
    "bf16-true": (
        "bf16 params, bf16 gradient all-reduce (DDP reduces in the parameter dtype); no fp32 master weights"
    ),
    "fp16-true": (
        "fp16 params, fp16 all-reduce of the scaled gradients (DDP divides by the world size before "
        "summing) and a GradScaler per rank that skips together on every rank; no fp32 master weights"
    ),
}

_FSDP2_REASONS = {
    "fp32": "MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32): fp32 shards, all-gather and "
    "reduce-scatter; strict fp32 math per rank by precision_scope()",
    "tf32": "MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32): fp32 shards, all-gather and "
    "reduce-scatter; TF32 math per rank by precision_scope()",
    "bf32": "MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32): fp32 shards, all-gather and "
    "reduce-scatter; oneDNN bf16 math per rank by precision_scope()",
    "bf16-mixed": (
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 sharded master params, bf16 "
        "all-gather and compute, fp32 reduce-scatter; keep policy.autocast() for autocast's fp32 ops"
    ),
    "fp16-mixed": (
        "MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32): fp32 sharded master params, fp16 "
        "compute, fp32 reduce-scatter; the policy's GradScaler unscales the DTensor gradient shards and "
        "DTensor all-reduces found_inf over the mesh, so every rank skips together (no ShardedGradScaler)"
    ),
    "bf16-true": (
        "the model is bf16 after policy.prepare(), so FSDP2 keeps the sharded params and the optimizer "
        "step in bf16 (no fp32 master weights); gradients are reduce-scattered in fp32, stored as bf16"
    ),
    "fp16-true": (
        "the model is fp16 after policy.prepare(), so FSDP2 keeps the sharded params and the optimizer "
        "step in fp16 (no fp32 master weights); fp32 reduce-scatter; the policy's GradScaler unscales the "
        "fp16 DTensor shards and DTensor syncs found_inf over the mesh"
    ),
}


def support(policy: Policy | str, wrapper: Wrapper | str, backend: str | None = None) -> Support:
    """Can ``policy`` run under ``wrapper`` ("ddp" or "fsdp2") on ``backend``, and why. Never raises
    for valid input.

    ``policy`` is a :class:`Policy` (its device and options are checked too) or a policy name.
    ``backend`` defaults to the initialised process group's backend, else nccl for a CUDA policy
    and gloo for a CPU one. Whether the policy runs on the device at all is
    :meth:`Policy.check_support`'s business, not this function's.
    """
    spec = _spec_of(policy)
    wrapper = _check_wrapper(wrapper)
    if backend is None:
        backend = _default_backend(policy)
    backend_note = _backend_support(policy, backend)
    if backend_note is not None and not backend_note:
        return backend_note

    if wrapper == "ddp":
        reason = _DDP_REASONS[spec.name]
    else:
        try:
            _fsdp()
        except ImportError:
            return Support(False, f"this torch ({torch.__version__}) has no FSDP2 fully_shard", "ddp")
        if spec.loss_scaling and not _dtensor_syncs_found_inf():
            return Support(
                False,
                f"this torch ({torch.__version__}) does not all-reduce found_inf for DTensor gradients, so a "
                "plain GradScaler could skip on some ranks only; it needs "
                "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
                "bf16-mixed, or torch >= 2.5",
            )
        if isinstance(policy, Policy) and policy.config.channels_last:
            return Support(
                False,
                "fully_shard refuses non-contiguous parameters ('FSDP does not support non-contiguous "
                "parameters'), and channels_last convolution weights are non-contiguous",
                f"{spec.name} without channels_last, or channels_last under ddp",
            )
        reason = _FSDP2_REASONS[spec.name]
    if backend_note is not None:
        reason = f"{reason}; {backend_note.reason}"
    return Support(True, reason)


# ---------------------------------------------------------------------------------------- DDP
@dataclass(frozen=True)
class DDPConfig:
    """What DistributedDataParallel needs for one policy. Pure data; see :func:`ddp_config`."""

    policy: str
    wrapper: str  # the class to wrap with
    param_dtype: torch.dtype  # what DDP holds and broadcasts (fp32 islands stay fp32)
    autocast_dtype: torch.dtype | None  # per rank: ``with policy.autocast():``
    loss_scaling: bool  # per rank: the policy's own GradScaler (policy.backward / policy.step)
    reduce_dtype: torch.dtype  # dtype of the gradient all-reduce
    comm_hook: str | None  # qualified name of the DDP comm hook to register, None: DDP's built-in
    supported: bool
    reason: str
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.supported

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "wrapper": self.wrapper,
            "param_dtype": _dtype_name(self.param_dtype),
            "autocast_dtype": None if self.autocast_dtype is None else _dtype_name(self.autocast_dtype),
            "loss_scaling": self.loss_scaling,
            "reduce_dtype": _dtype_name(self.reduce_dtype),
            "comm_hook": self.comm_hook,
            "supported": self.supported,
            "reason": self.reason,
            "notes": list(self.notes),
        }


def _compress_dtype(spec: PolicySpec, compress_grads: bool | str | torch.dtype) -> torch.dtype | None:
    """The dtype to compress gradients to, or None for no hook. Raises PolicyError on bad input."""
    if compress_grads is False or compress_grads is None:
        return None
    if compress_grads is True:
        if spec.name in _FP32_STORAGE:
            raise PolicyError(
                f"compress_grads=True has no low-precision dtype to use under {spec.name!r}, which keeps "
                "gradients in fp32; pass compress_grads=torch.bfloat16 or torch.float16 to compress its "
                "all-reduce anyway (it changes the numerics of an fp32 policy)."
            )
        if spec.param_dtype is not None:
            return None  # *-true: gradients are already half; DDP reduces them in that dtype.
        return spec.autocast_dtype
    dtype = (
        _COMPRESS_ALIASES.get(compress_grads.lower()) if isinstance(compress_grads, str) else compress_grads
    )
    if dtype not in (torch.float16, torch.bfloat16):
        raise PolicyError(
            f"compress_grads must be False, True, torch.float16 or torch.bfloat16 ('fp16'/'bf16'), got "
            f"{compress_grads!r}."
        )
    return dtype


def ddp_config(
    policy: Policy | str,
    *,
    compress_grads: bool | str | torch.dtype = False,
    backend: str | None = None,
) -> DDPConfig:
    """What DDP needs for ``policy``: autocast and scaler per rank, the all-reduce dtype, the comm hook.

    Parameters and the gradient all-reduce stay fp32 for fp32-storage policies (*-mixed, fp32,
    tf32, bf32); *-true policies hold and reduce half-precision parameters. Gradient compression
    is opt-in: ``compress_grads=True`` registers DDP's fp16/bf16 compression hook matching a
    *-mixed policy's compute dtype (no hook for *-true, whose gradients are already half); an
    fp32 policy needs an explicit dtype. Unsupported combinations come back with
    ``supported=False`` and the reason; :func:`apply_ddp` raises on them.
    """
    spec = _spec_of(policy)
    compress = _compress_dtype(spec, compress_grads)
    if backend is None:
        backend = _default_backend(policy)
    param_dtype = spec.param_dtype or torch.float32
    notes: list[str] = []
    if isinstance(policy, Policy) and policy.config.keep_fp32:
        notes.append(
            "keep_fp32 modules keep fp32 params: DDP buckets them separately and reduces them in fp32"
        )
    if spec.param_dtype is not None:
        notes.append(
            f"no fp32 master weights: every rank steps {_dtype_name(spec.param_dtype)} params; "
            "label results so"
        )
        if compress_grads is True:
            notes.append(
                f"compress_grads=True adds no hook: the gradients are already {_dtype_name(param_dtype)}"
            )
    comm_hook = _HOOKS[compress] if compress is not None else None
    reduce_dtype = compress or param_dtype
    if compress is not None:
        notes.append(
            f"gradients are cast to {_dtype_name(compress)} and divided by the world size before the "
            "all-reduce (the 'reduce dtype'), then cast back into the fp32 gradient buckets"
        )
        if compress == torch.float16 and spec.loss_scaling:
            notes.append(
                "the fp16 hook casts the *scaled* gradients: a value above 65504 becomes inf on every rank "
                "after the all-reduce, the step is skipped everywhere and the scale backs off"
            )
    supported, reason = True, _DDP_REASONS[spec.name]
    backend_note = _backend_support(policy, backend)
    if backend_note is not None:
        supported = backend_note.supported
        reason = backend_note.reason if not supported else f"{reason}; {backend_note.reason}"
    if supported and compress is not None:
        supported, why = _hook_support(compress, backend)
        if not supported:
            reason = why
        elif why:
            notes.append(why)
    return DDPConfig(
        policy=spec.name,
        wrapper="torch.nn.parallel.DistributedDataParallel",
        param_dtype=param_dtype,
        autocast_dtype=spec.autocast_dtype,
        loss_scaling=spec.loss_scaling,
        reduce_dtype=reduce_dtype,
        comm_hook=comm_hook,
        supported=supported,
        reason=reason,
        notes=tuple(notes),
    )


def _hook_support(dtype: torch.dtype, backend: str | None) -> tuple[bool, str]:
    """(supported, reason or note) for DDP's fp16/bf16 compression hook on ``backend``."""
    name = _dtype_name(dtype)
    if backend == "gloo":
        return True, (
            f"gloo all-reduces {name} tensors (checked on CPU tensors with torch 2.14: the {name} compress "
            "hook runs and every rank gets the same gradients)"
        )
    if backend == "nccl":
        if dtype == torch.bfloat16:
            version = _nccl_version()
            if version is not None and version < (2, 10):
                return False, (
                    f"bf16_compress_hook needs NCCL >= 2.10 for bf16 all-reduce; this torch has NCCL "
                    f"{'.'.join(map(str, version))}; use compress_grads=torch.float16 or no compression"
                )
        return True, ""
    if backend is None:
        return True, "backend not known yet: apply_ddp checks it against the process group"
    return False, (
        f"mixprec has not verified {name} gradient compression on the {backend!r} backend (verified: gloo, "
        "nccl); register the hook yourself with ddp_model.register_comm_hook if your backend reduces "
        f"{name}"
    )


def _resolve_hook(dtype: torch.dtype):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.fp16_compress_hook if dtype == torch.float16 else default_hooks.bf16_compress_hook


def _require_initialized(what: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            f"{what} needs an initialised process group: run under torchrun (or torch.multiprocessing) and "
            "call torch.distributed.init_process_group('nccl' or 'gloo') first."
        )


def _check_prepared(model: nn.Module, policy: Policy, what: str, *, check_device: bool) -> None:
    """Raise PolicyError unless ``policy.prepare(model)`` has visibly been applied."""
    if not isinstance(model, nn.Module):
        raise PolicyError(f"{what} takes a torch.nn.Module, got {type(model).__name__}.")
    hint = f"call model = policy.prepare(model) before {what}"
    islands = _island_names(model, policy)
    marked = [n for n in islands if getattr(model.get_submodule(n), "_mixprec_fp32_island", False)]
    if len(marked) != len(islands):
        missing = next(n for n in islands if n not in marked)
        raise PolicyError(f"keep_fp32 module {missing!r} is not an fp32 island yet; {hint}.")
    want = policy.spec.param_dtype or torch.float32
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        inside = any(name.startswith(i + ".") for i in islands)
        expected = torch.float32 if inside else want
        if p.dtype != expected:
            raise PolicyError(
                f"Parameter {name!r} is {p.dtype} but policy {policy.name!r} expects {expected} there; "
                f"{hint}."
            )
        if check_device and p.device.type != policy.device.type:
            raise PolicyError(
                f"Parameter {name!r} is on {p.device} but the policy's device is {policy.device}; {hint}."
            )


def apply_ddp(
    model: nn.Module,
    policy: Policy,
    *,
    device_ids: Sequence[int] | None = None,
    compress_grads: bool | str | torch.dtype = False,
    process_group: ProcessGroup | None = None,
) -> DistributedDataParallel:
    """Wrap a prepared model in DistributedDataParallel for ``policy``; returns the DDP module.

    Call ``policy.prepare(model)`` first (device, *-true casts, fp32 islands). Autocast and loss
    scaling stay per rank: keep using ``policy.autocast()``, ``policy.backward()`` and
    ``policy.step()``. ``compress_grads`` registers DDP's fp16/bf16 compression hook (see
    :func:`ddp_config`); it raises :class:`UnsupportedError` where the backend cannot reduce
    that dtype, and is never registered unless asked for.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(policy, Policy):
        raise PolicyError(f"apply_ddp takes a mixprec Policy, got {type(policy).__name__}.")
    _check_prepared(model, policy, "apply_ddp", check_device=True)
    _require_initialized("apply_ddp")
    backend = str(dist.get_backend(process_group))
    config = ddp_config(policy, compress_grads=compress_grads, backend=backend)
    if not config.supported:
        raise UnsupportedError(f"Policy {policy.name!r} under DDP on {backend}: {config.reason}.")
    if device_ids is None and policy.device.type == "cuda":
        index = policy.device.index if policy.device.index is not None else torch.cuda.current_device()
        device_ids = [index]
    ddp = DistributedDataParallel(
        model,
        device_ids=list(device_ids) if device_ids is not None else None,
        process_group=process_group,
    )
    if config.comm_hook is not None:
        ddp.register_comm_hook(process_group, _resolve_hook(config.reduce_dtype))
    return ddp


# ---------------------------------------------------------------------------------------- FSDP2
def fsdp_mp_policy(policy: Policy | str) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for ``policy`` (for the blocks and the root).

    - fp32 / tf32 / bf32: ``param_dtype=fp32, reduce_dtype=fp32``.
    - *-mixed: ``param_dtype`` = the compute dtype (bf16/fp16) for the all-gather and forward,
      ``reduce_dtype=fp32`` so gradients are reduce-scattered in fp32 into the fp32 sharded
      master params; ``output_dtype=None``: outputs keep the dtype they have under single-device
      autocast, and ``policy.autocast()`` must still wrap forward and loss so autocast's fp32 ops
      (softmax, norms, losses) run in fp32 as on one device.
    - *-true: ``param_dtype`` = the half dtype, which equals the dtype ``policy.prepare()`` gave
      the model, so FSDP2 stores the sharded params (and steps them) in half: no fp32 master
      weights, as the policy says; ``reduce_dtype=fp32`` sums the ranks' gradients in fp32 (no
      fp16 overflow of scaled sums, one rounding) before they are cast back to half.

    ``cast_forward_inputs=True`` throughout. fp32 islands get ``MixedPrecisionPolicy(fp32, fp32)``
    from :func:`shard_model`.
    """
    _, MixedPrecisionPolicy, _ = _fsdp()
    spec = _spec_of(policy)
    low = spec.low_precision_dtype
    if low is None:
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=None)


def _fp32_mp_policy() -> MixedPrecisionPolicy:
    _, MixedPrecisionPolicy, _ = _fsdp()
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def find_blocks(model: nn.Module, block_types: Sequence[type[nn.Module]] | None = None) -> list[str]:
    """Names of the modules :func:`shard_model` shards one by one (the root excluded).

    With ``block_types``: every submodule that is an instance of one of them. Without: the
    children (with parameters) of the ``nn.ModuleList`` / ``nn.Sequential`` holding the most
    parameters, e.g. the transformer layers. Empty when the model has no such container.
    """
    named = dict(model.named_modules())
    if block_types is not None:
        types = tuple(block_types)
        if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
            raise PolicyError(f"block_types must be nn.Module subclasses, got {block_types!r}.")
        found = [n for n, m in named.items() if n and isinstance(m, types)]
        if not found:
            present = sorted({type(m).__name__ for m in named.values()})
            raise PolicyError(
                f"No module of {type(model).__name__} is a {' or '.join(t.__name__ for t in types)}; "
                f"module types present: {', '.join(present[:12])}."
            )
        return found

    def n_params(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    containers = [(n, m) for n, m in named.items() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    containers = [(n, m) for n, m in containers if n_params(m) > 0]
    if not containers:
        return []
    # Most parameters wins; on a tie the outermost (first in module order) does.
    best_name, best = max(containers, key=lambda item: n_params(item[1]))
    prefix = f"{best_name}." if best_name else ""
    return [f"{prefix}{child}" for child, m in best.named_children() if n_params(m) > 0]


def _island_names(model: nn.Module, policy: Policy) -> list[str]:
    """keep_fp32 modules, matched the way Policy.prepare matches them."""
    return island_names(model, policy.config.keep_fp32)


@dataclass(frozen=True)
class ShardGroup:
    """One ``fully_shard`` call of :func:`shard_model`: the module (``""`` = root) and its policy."""

    name: str
    mp_policy: MixedPrecisionPolicy
    role: str  # "block", "keep_fp32", "block in keep_fp32" or "root"


def sharding_plan(
    model: nn.Module, policy: Policy, *, block_types: Sequence[type[nn.Module]] | None = None
) -> list[ShardGroup]:
    """The ``fully_shard`` calls :func:`shard_model` makes, in order (bottom-up, root last).

    Pure: needs no process group. keep_fp32 modules with parameters get an fp32
    MixedPrecisionPolicy of their own (else the enclosing group would all-gather their params
    in the low-precision dtype); blocks inside a keep_fp32 module get it too.
    """
    if not isinstance(model, nn.Module):
        raise PolicyError(f"sharding_plan takes a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(policy, Policy):
        raise PolicyError(f"sharding_plan takes a mixprec Policy, got {type(policy).__name__}.")
    islands = _island_names(model, policy)
    blocks = find_blocks(model, block_types)

    def in_island(name: str) -> bool:
        return any(name == i or name.startswith(i + ".") for i in islands)

    candidates: dict[str, str] = {}
    for name in blocks:
        candidates[name] = "block in keep_fp32" if in_island(name) else "block"
    for name in islands:
        candidates.setdefault(name, "keep_fp32")
    # Bottom-up: deepest first, so each call only takes the params no deeper group took.
    order = sorted(candidates, key=lambda n: -n.count("."))
    claimed: set[int] = set()
    plan: list[ShardGroup] = []
    low_policy, fp32_policy = fsdp_mp_policy(policy), _fp32_mp_policy()
    for name in order:
        params = {id(p) for p in model.get_submodule(name).parameters()} - claimed
        if not params:
            continue
        claimed |= params
        role = candidates[name]
        plan.append(ShardGroup(name, low_policy if role == "block" else fp32_policy, role))
    plan.append(ShardGroup("", low_policy, "root"))
    return plan


def shard_model(
    model: nn.Module,
    policy: Policy,
    *,
    block_types: Sequence[type[nn.Module]] | None = None,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` block by block with ``policy``'s mixed precision; returns ``model``.

    Call ``policy.prepare(model)`` first. Each block (see :func:`find_blocks`) is sharded with
    :func:`fsdp_mp_policy`, each keep_fp32 module with an fp32 policy of its own, then the root.
    ``mesh`` defaults to a 1-D mesh over the world on the policy's device type. Keep the usual
    loop: ``policy.autocast()``, ``policy.backward()``, ``policy.step()``; the policy's scaler
    works on the sharded DTensor gradients and every rank skips the same steps.
    """
    import torch.distributed as dist

    if not isinstance(policy, Policy):
        raise PolicyError(f"shard_model takes a mixprec Policy, got {type(policy).__name__}.")
    fully_shard, _, FSDPModule = _fsdp()
    if isinstance(model, FSDPModule):
        raise PolicyError("The model is already sharded with fully_shard; shard it once.")
    _check_prepared(model, policy, "shard_model", check_device=False)
    _require_initialized("shard_model")
    verdict = support(policy, "fsdp2", str(dist.get_backend()))
    if not verdict:
        hint = f"; try {verdict.suggestion}" if verdict.suggestion else ""
        raise UnsupportedError(f"Policy {policy.name!r} under FSDP2: {verdict.reason}{hint}.")
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        if policy.device.type == "cuda":
            current = torch.cuda.current_device()
            if policy.device.index is not None and policy.device.index != current:
                raise UsageError(
                    f"The policy's device is {policy.device} but the current CUDA device is cuda:{current}; "
                    "call torch.cuda.set_device(local_rank) before shard_model (FSDP2 shards onto it)."
                )
        mesh = init_device_mesh(policy.device.type, (dist.get_world_size(),))
    for group in sharding_plan(model, policy, block_types=block_types):
        module = model.get_submodule(group.name) if group.name else model
        fully_shard(module, mesh=mesh, mp_policy=group.mp_policy)
    # fully_shard replaced the parameters with DTensor ones: let the policy name them in
    # stats.last_nonfinite_params again (it keys names by parameter identity).
    policy.refresh_param_names(model)
    return model


# ---------------------------------------------------------------------------------------- checks
def assert_stats_agree(policy: Policy, group: ProcessGroup | None = None) -> dict[str, Any]:
    """All-gather steps, skipped steps, last skipped step and scale; raise if any rank differs.

    A collective: call it on every rank of ``group``. Returns this rank's values. Without an
    initialised process group there is one rank, which trivially agrees with itself.
    """
    import torch.distributed as dist

    if not isinstance(policy, Policy):
        raise PolicyError(f"assert_stats_agree takes a mixprec Policy, got {type(policy).__name__}.")
    stats = policy.stats
    mine = {
        "steps": stats.steps,
        "skipped_steps": stats.skipped_steps,
        "last_skipped_step": stats.last_skipped_step,
        "scale": stats.scale,
    }
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if any(other != gathered[0] for other in gathered[1:]):
        keys = [k for k in mine if len({repr(g[k]) for g in gathered}) > 1]
        shown = "; ".join(
            f"rank {r}: " + ", ".join(f"{k}={g[k]}" for k in keys) for r, g in enumerate(gathered)
        )
        raise StatsMismatchError(
            f"Ranks disagree on {', '.join(keys)} ({shown}): their weights have diverged. Every rank "
            "must run policy.step() on every iteration, with the gradients DDP/FSDP2 synchronised.",
            per_rank=gathered,
        )
    return mine
