"""DistributedDataParallel for a policy: what it needs (:func:`ddp_config`) and the wrapping."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.distributed.common import (
    COMPRESS_ALIASES,
    HOOKS,
    backend_support,
    check_prepared,
    default_backend,
    dtype_name,
    nccl_version,
    policy_spec,
    require_initialized,
)
from mixprec.distributed.support import ddp_reason
from mixprec.errors import PolicyError, UnsupportedError
from mixprec.policy.policy import Policy
from mixprec.policy.registry import PolicySpec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.nn.parallel import DistributedDataParallel


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
            "param_dtype": dtype_name(self.param_dtype),
            "autocast_dtype": None if self.autocast_dtype is None else dtype_name(self.autocast_dtype),
            "loss_scaling": self.loss_scaling,
            "reduce_dtype": dtype_name(self.reduce_dtype),
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
        if spec.is_math_mode:  # fp32 storage: fp32 gradients
            raise PolicyError(
                f"compress_grads=True has no low-precision dtype to use under {spec.name!r}, which keeps "
                "gradients in fp32; pass compress_grads=torch.bfloat16 or torch.float16 to compress its "
                "all-reduce anyway (it changes the numerics of an fp32 policy)."
            )
        if spec.param_dtype is not None:
            return None  # *-true: gradients are already half; DDP reduces them in that dtype.
        return spec.autocast_dtype
    dtype = (
        COMPRESS_ALIASES.get(compress_grads.lower()) if isinstance(compress_grads, str) else compress_grads
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
    spec = policy_spec(policy)
    compress = _compress_dtype(spec, compress_grads)
    if backend is None:
        backend = default_backend(policy)
    param_dtype = spec.param_dtype or torch.float32
    notes: list[str] = []
    if isinstance(policy, Policy) and policy.config.keep_fp32:
        notes.append(
            "keep_fp32 modules keep fp32 params: DDP buckets them separately and reduces them in fp32"
        )
    if spec.param_dtype is not None:
        notes.append(
            f"no fp32 master weights: every rank steps {dtype_name(spec.param_dtype)} params; "
            "label results so"
        )
        if compress_grads is True:
            notes.append(
                f"compress_grads=True adds no hook: the gradients are already {dtype_name(param_dtype)}"
            )
    comm_hook = HOOKS[compress] if compress is not None else None
    reduce_dtype = compress or param_dtype
    if compress is not None:
        notes.append(
            f"gradients are cast to {dtype_name(compress)} and divided by the world size before the "
            "all-reduce (the 'reduce dtype'), then cast back into the fp32 gradient buckets"
        )
        if compress == torch.float16 and spec.loss_scaling:
            notes.append(
                "the fp16 hook casts the *scaled* gradients: a value above 65504 becomes inf on every rank "
                "after the all-reduce, the step is skipped everywhere and the scale backs off"
            )
    supported, reason = True, ddp_reason(spec)
    backend_note = backend_support(policy, backend)
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
    name = dtype_name(dtype)
    if backend == "gloo":
        return True, (
            f"gloo all-reduces {name} tensors (checked on CPU tensors with torch 2.14: the {name} compress "
            "hook runs and every rank gets the same gradients)"
        )
    if backend == "nccl":
        if dtype == torch.bfloat16:
            version = nccl_version()
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
    check_prepared(model, policy, "apply_ddp", check_device=True)
    require_initialized("apply_ddp")
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
