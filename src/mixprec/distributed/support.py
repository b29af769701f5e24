"""Whether a policy can run under DDP or FSDP2 on a backend, and what each wrapper does with it."""

from __future__ import annotations

import torch

from mixprec.distributed.common import (
    Wrapper,
    backend_support,
    check_wrapper,
    default_backend,
    dtensor_syncs_found_inf,
    fsdp_api,
    policy_spec,
)
from mixprec.policy.policy import Policy
from mixprec.policy.registry import PolicySpec
from mixprec.policy.support import Support


def ddp_reason(spec: PolicySpec) -> str:
    """What DistributedDataParallel does with a policy, from the policy's facts."""
    fmt = spec.compute_format
    if spec.low_format is not None:
        kind = "torchao Float8Linear" if spec.fp8_recipe is not None else f"{spec.name} Linear layers"
        return (
            f"fp32 params and fp32 gradient all-reduce; each rank converts its replica's Linear layers to "
            f"{kind} and runs bf16 autocast around them"
        )
    if spec.is_math_mode:
        return (
            f"fp32 params and fp32 gradient all-reduce; the {spec.name} fp32 math mode is set per rank by "
            "precision_scope()"
        )
    if spec.is_mixed:
        scaler = " and the policy's GradScaler" if spec.loss_scaling else ""
        skips = (
            "the all-reduce spreads inf/NaN to all ranks, so every scaler skips and backs off together"
            if spec.loss_scaling
            else "with finite_check=True every rank skips together because the all-reduce spreads inf/NaN "
            "to all ranks"
        )
        return f"autocast({fmt}){scaler} per rank; params and the gradient all-reduce stay fp32; {skips}"
    scaled = (
        " of the scaled gradients (DDP divides by the world size before summing) and a GradScaler per rank "
        "that skips together on every rank"
        if spec.loss_scaling
        else " (DDP reduces in the parameter dtype)"
    )
    return f"{fmt} params, {fmt} gradient all-reduce{scaled}; no fp32 master weights"


def fsdp2_reason(spec: PolicySpec) -> str:
    """What FSDP2's fully_shard does with a policy, from the policy's facts."""
    fmt = spec.compute_format
    if spec.is_math_mode:
        return (
            "MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32): fp32 shards, all-gather and "
            f"reduce-scatter; the {spec.name} fp32 math mode per rank by precision_scope()"
        )
    found_inf = (
        "; the policy's GradScaler unscales the DTensor gradient shards and DTensor all-reduces found_inf "
        "over the mesh, so every rank skips together (no ShardedGradScaler)"
        if spec.loss_scaling
        else ""
    )
    if spec.is_mixed:
        return (
            f"MixedPrecisionPolicy(param_dtype={fmt}, reduce_dtype=fp32): fp32 sharded master params, {fmt} "
            f"all-gather and compute, fp32 reduce-scatter; keep policy.autocast() for autocast's fp32 ops"
            + found_inf
        )
    return (
        f"the model is {fmt} after policy.prepare(), so FSDP2 keeps the sharded params and the optimizer "
        f"step in {fmt} (no fp32 master weights); gradients are reduce-scattered in fp32, stored as {fmt}"
        + found_inf
    )


def support(policy: Policy | str, wrapper: Wrapper | str, backend: str | None = None) -> Support:
    """Can ``policy`` run under ``wrapper`` ("ddp" or "fsdp2") on ``backend``, and why. Never raises
    for valid input.

    ``policy`` is a :class:`Policy` (its device and options are checked too) or a policy name.
    ``backend`` defaults to the initialised process group's backend, else nccl for a CUDA policy
    and gloo for a CPU one. Whether the policy runs on the device at all is
    :meth:`Policy.check_support`'s business, not this function's.
    """
    spec = policy_spec(policy)
    wrapper = check_wrapper(wrapper)
    if backend is None:
        backend = default_backend(policy)
    backend_note = backend_support(policy, backend)
    if backend_note is not None and not backend_note:
        return backend_note

    if wrapper == "ddp":
        reason = ddp_reason(spec)
    else:
        try:
            fsdp_api()
        except ImportError:
            return Support(False, f"this torch ({torch.__version__}) has no FSDP2 fully_shard", "ddp")
        if spec.loss_scaling and not dtensor_syncs_found_inf():
            return Support(
                False,
                f"this torch ({torch.__version__}) does not all-reduce found_inf for DTensor gradients, so a "
                "plain GradScaler could skip on some ranks only; it needs "
                "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
                "bf16-mixed, or torch >= 2.5",
            )
        if spec.block_format is not None:
            return Support(
                False,
                f"{spec.name} under fully_shard needs its block-scaled all-gather, which mixprec does not "
                "apply or check yet",
                f"{spec.name} under ddp, or bf16-mixed under fsdp2",
            )
        if spec.fp8_recipe is not None:
            return Support(
                False,
                "torchao's Float8Linear under fully_shard needs torchao's FSDP2 float8 settings "
                "(fp8 all-gather, precomputed scales), which mixprec does not apply or check yet",
                f"{spec.name} under ddp, or bf16-mixed under fsdp2",
            )
        if isinstance(policy, Policy) and policy.config.channels_last:
            return Support(
                False,
                "fully_shard refuses non-contiguous parameters ('FSDP does not support non-contiguous "
                "parameters'), and channels_last convolution weights are non-contiguous",
                f"{spec.name} without channels_last, or channels_last under ddp",
            )
        reason = fsdp2_reason(spec)
    if backend_note is not None:
        reason = f"{reason}; {backend_note.reason}"
    return Support(True, reason)
