"""What the DDP and FSDP2 wrappers share: names, policy lookup, backend facts and preconditions."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from mixprec.errors import PolicyError, UsageError, did_you_mean
from mixprec.policy.islands import batch_norm_layers, island_names
from mixprec.policy.policy import Policy
from mixprec.policy.registry import PolicySpec, spec_of
from mixprec.policy.support import Support

WRAPPERS: tuple[str, ...] = ("ddp", "fsdp2")
Wrapper = Literal["ddp", "fsdp2"]

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
COMPRESS_ALIASES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
HOOKS = {
    torch.float16: "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
    torch.bfloat16: "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook",
}
# Backends on which mixprec has run the wrappers (gloo: CPU tensors; nccl: CUDA tensors).
VERIFIED_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


def dtype_name(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def policy_spec(policy: Policy | str) -> PolicySpec:
    if isinstance(policy, Policy):
        return policy.spec
    if isinstance(policy, str):
        return spec_of(policy)
    raise PolicyError(f"Expected a mixprec Policy or a policy name, got {type(policy).__name__} {policy!r}.")


def check_wrapper(wrapper: str) -> str:
    key = wrapper.strip().lower() if isinstance(wrapper, str) else wrapper
    aliases = {"fsdp": "fsdp2", "fully_shard": "fsdp2", "distributeddataparallel": "ddp"}
    key = aliases.get(key, key)
    if key not in WRAPPERS:
        raise PolicyError(
            f"Unknown wrapper {wrapper!r}; valid: {', '.join(WRAPPERS)}."
            f"{did_you_mean(str(wrapper), WRAPPERS)}"
        )
    return key


def default_backend(policy: Policy | str) -> str | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    if isinstance(policy, Policy):
        return "nccl" if policy.device.type == "cuda" else "gloo"
    return None


def fsdp_api():
    """(fully_shard, MixedPrecisionPolicy, FSDPModule): public since torch 2.6, _composable before."""
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import (
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )
    return fully_shard, MixedPrecisionPolicy, FSDPModule


def dtensor_syncs_found_inf() -> bool:
    """True when DTensor all-reduces found_inf inside GradScaler's unscale kernel (torch >= ~2.5)."""
    try:
        from torch.distributed.tensor import DTensor

        handlers = DTensor._op_dispatcher._custom_op_handlers
    except (ImportError, AttributeError):
        return False
    return torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default in handlers


def nccl_version() -> tuple[int, ...] | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return tuple(version) if isinstance(version, tuple) else None


def backend_support(policy: Policy | str, backend: str | None) -> Support | None:
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
    verified = VERIFIED_BACKEND_DEVICE.get(backend)
    if verified != device:
        return Support(
            True,
            f"{backend} with {device} tensors is not verified by mixprec (verified: gloo with cpu, nccl "
            "with cuda)" + ("; nccl is the fast path on GPUs" if device == "cuda" else ""),
        )
    return None


def require_initialized(what: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            f"{what} needs an initialised process group: run under torchrun (or torch.multiprocessing) and "
            "call torch.distributed.init_process_group('nccl' or 'gloo') first."
        )


def check_prepared(model: nn.Module, policy: Policy, what: str, *, check_device: bool) -> None:
    """Raise PolicyError unless ``policy.prepare(model)`` has visibly been applied."""
    if not isinstance(model, nn.Module):
        raise PolicyError(f"{what} takes a torch.nn.Module, got {type(model).__name__}.")
    hint = f"call model = policy.prepare(model) before {what}"
    islands = policy_island_names(model, policy)
    marked = [n for n in islands if getattr(model.get_submodule(n), "_mixprec_fp32_island", False)]
    if len(marked) != len(islands):
        missing = next(n for n in islands if n not in marked)
        raise PolicyError(f"keep_fp32 module {missing!r} is not an fp32 island yet; {hint}.")
    want = policy.spec.param_dtype or torch.float32
    # prepare() keeps these fp32 under every policy: the islands, and BatchNorm (*-true keeps its
    # weights fp32 next to its fp32 running statistics)
    fp32 = [*islands, *batch_norm_layers(model)]
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        inside = any(name.startswith(i + ".") for i in fp32)
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


def autocast_fp32_params(model: torch.nn.Module) -> dict[str, set[int]]:
    """Module name ("" = the root) -> ids of the parameters it holds directly that autocast does not
    cast to the compute dtype: what FSDP2 must all-gather in fp32 under a *-mixed policy so that the
    ops see what they see on one device. Modules without such parameters are left out.

    Autocast casts the weights of Linear and the (transposed) convolutions, biases included, for its
    low-precision ops: those may be gathered in the compute dtype. Any other parameter (norms,
    embeddings, a parameter a custom module uses directly, MultiheadAttention's bias_k concatenated
    to a bf16 key) reaches an op autocast runs in fp32 or does not cast at all: gathered in bf16,
    that op, and the residual stream it feeds, would run in bf16. A weight tied between an embedding
    and a head counts (the embedding looks its rows up in the weight's own dtype). Needs only torch,
    so the fsdp2 export can paste it.
    """
    casts = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)
    found: dict[str, set[int]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, casts):
            ids = {id(p) for p in module.parameters(recurse=False) if p.is_floating_point()}
            if ids:
                found[name] = ids
    return found


def policy_island_names(model: nn.Module, policy: Policy) -> list[str]:
    """keep_fp32 modules, matched the way Policy.prepare matches them."""
    return island_names(model, policy.config.keep_fp32)
