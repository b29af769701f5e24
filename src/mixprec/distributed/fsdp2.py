"""FSDP2 (``fully_shard``) for a policy: its MixedPrecisionPolicy, the sharding plan, and the sharding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mixprec.distributed.common import (
    autocast_fp32_params,
    check_prepared,
    fsdp_api,
    policy_island_names,
    policy_spec,
    require_initialized,
)
from mixprec.distributed.support import support
from mixprec.errors import PolicyError, UnsupportedError, UsageError
from mixprec.policy.islands import island_names
from mixprec.policy.policy import Policy, PolicyConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


def fsdp_mp_policy(policy: Policy | str) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for ``policy`` (for the blocks and the root).

    - fp32 / tf32 / bf32: ``param_dtype=fp32, reduce_dtype=fp32``.
    - *-mixed: ``param_dtype`` = the compute dtype (bf16/fp16) for the all-gather and forward,
      ``reduce_dtype=fp32`` so gradients are reduce-scattered in fp32 into the fp32 sharded
      master params; ``output_dtype=None`` and ``cast_forward_inputs=False``: inputs and outputs
      keep the dtype they have under single-device autocast (a block's fp32 residual-stream input
      stays fp32), and ``policy.autocast()`` must still wrap forward and loss: it does the casting,
      as on one device. Only Linear/conv weights are gathered in this dtype (autocast casts them
      anyway); :func:`sharding_plan` gives norms, embeddings and other parameters fp32 groups.
    - *-true: ``param_dtype`` = the half dtype, which equals the dtype ``policy.prepare()`` gave
      the model, so FSDP2 stores the sharded params (and steps them) in half: no fp32 master
      weights, as the policy says; ``reduce_dtype=fp32`` sums the ranks' gradients in fp32 (no
      fp16 overflow of scaled sums, one rounding) before they are cast back to half.

    ``cast_forward_inputs=True`` for the other policies. fp32 islands get
    ``MixedPrecisionPolicy(fp32, fp32)`` from :func:`shard_model`.
    """
    _, MixedPrecisionPolicy, _ = fsdp_api()
    spec = policy_spec(policy)
    low = spec.low_precision_dtype
    if low is None:
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mixed = spec.autocast_dtype is not None
    return MixedPrecisionPolicy(
        param_dtype=low, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=not mixed
    )


def _fp32_mp_policy(cast_forward_inputs: bool = True) -> MixedPrecisionPolicy:
    _, MixedPrecisionPolicy, _ = fsdp_api()
    return MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=cast_forward_inputs
    )


def batch_norm_mp_policy() -> MixedPrecisionPolicy:
    """BatchNorm's group under a low-precision policy: fp32 all-gathers and reduce-scatters, and its
    inputs left in the dtype they come in (``cast_forward_inputs=False``). BatchNorm computes with its
    fp32 weights and running statistics and returns the input's dtype, as on one device; cast to
    fp32, its output would reach the half layer after it in the same block as fp32."""
    _, MixedPrecisionPolicy, _ = fsdp_api()
    return MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


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


@dataclass(frozen=True)
class ShardGroup:
    """One ``fully_shard`` call of :func:`shard_model`: the module (``""`` = root) and its policy."""

    name: str
    mp_policy: MixedPrecisionPolicy
    role: str  # "block", "keep_fp32", "block in keep_fp32", "batch norm", "autocast fp32" or "root"


def sharding_plan(
    model: nn.Module, policy: Policy, *, block_types: Sequence[type[nn.Module]] | None = None
) -> list[ShardGroup]:
    """The ``fully_shard`` calls :func:`shard_model` makes, in order (bottom-up, root last).

    Pure: needs no process group. keep_fp32 modules with parameters get an fp32
    MixedPrecisionPolicy of their own (else the enclosing group would all-gather their params
    in the low-precision dtype); blocks inside a keep_fp32 module get it too, and so do BatchNorm
    layers under a low-precision policy (their running statistics are fp32 buffers FSDP2 does not
    cast: gathered in half, the weights would not match them; kept fp32, the layer takes half
    inputs as it does under autocast on one device). A parameter shared by two modules (tied
    weights) must be sharded by one group: a block that would split a tie is left to the group
    around it, and under *-true a keep_fp32 module that would is refused (one all-gather, one
    dtype: the island fp32, the other side half). Under *-mixed only Linear/conv parameters are
    gathered in the compute dtype (autocast casts them anyway): every other module holding
    parameters (LayerNorm, embeddings, ...) is an "autocast fp32" group, and a block or the root
    still holding such a parameter (its own, a tie, or a keep_fp32 module's left to it because it
    is tied to a module outside: a head tied to the embedding) gets the fp32 policy, so every op
    sees the dtypes it sees on one device; see
    :func:`mixprec.distributed.common.autocast_fp32_params`.
    """
    if not isinstance(model, nn.Module):
        raise PolicyError(f"sharding_plan takes a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(policy, Policy):
        raise PolicyError(f"sharding_plan takes a mixprec Policy, got {type(policy).__name__}.")
    islands = policy_island_names(model, policy)
    return _plan(model, policy, islands, find_blocks(model, block_types))


def keep_fp32_units(
    model: nn.Module, policy: Policy | PolicyConfig, *, blocks: Sequence[str] | None = None
) -> int:
    """How many ``fully_shard`` units ``policy``'s keep_fp32 set adds to its plan on ``model``: the
    :func:`sharding_plan` with the set less the one without it (blocks, BatchNorm and, under *-mixed,
    the modules autocast leaves in fp32 are units either way).

    FSDP2 all-gathers a unit's parameters in one dtype (pytorch#156784 asks for more), so an fp32
    island holding parameters outside the blocks is a unit of its own: its own all-gather in forward,
    another in backward (``fully_shard`` reshards after forward by default) and its own
    reduce-scatter each step, more collective calls over the same bytes. An island that is a block,
    lies inside one, is already a unit under *-mixed (a LayerNorm) or is left to the group around a
    tie adds none. ``blocks``: the block names (default: :func:`find_blocks`'s). Raises
    :class:`PolicyError` where the plan does (a keep_fp32 module splitting a tie under *-true).
    """
    if not isinstance(policy, (Policy, PolicyConfig)):
        raise PolicyError(f"keep_fp32_units takes a mixprec Policy, got {type(policy).__name__}.")
    config = policy.config if isinstance(policy, Policy) else policy
    names = find_blocks(model) if blocks is None else list(blocks)
    kept = _plan(model, config.name, island_names(model, config.keep_fp32), names)
    return len(kept) - len(_plan(model, config.name, [], names))


def _plan(
    model: nn.Module, policy: Policy | str, islands: list[str], block_names: list[str]
) -> list[ShardGroup]:
    """:func:`sharding_plan` with the fp32 islands and the blocks found."""
    # *-mixed: autocast casts only Linear/conv weights itself. Every other parameter must reach its
    # ops in fp32, as on one device: its module is sharded like a block (ties stay whole) with the
    # fp32 policy, and a block or root still holding such a parameter gets the fp32 policy too.
    mixed = policy_spec(policy).autocast_dtype is not None
    by_module = autocast_fp32_params(model) if mixed else {}
    keep32 = set().union(*by_module.values())
    if mixed:  # an island tied to a module outside it is left to the group around both: fp32 there
        keep32 |= {id(p) for name in islands for p in model.get_submodule(name).parameters()}
    extra = [
        n
        for n in by_module
        if n and n not in block_names and not any(n == i or n.startswith(i + ".") for i in islands)
    ]
    blocks = [model.get_submodule(name) for name in [*block_names, *extra]]
    low = policy_spec(policy).low_precision_dtype is not None
    try:
        groups = fsdp_groups(model, blocks, islands, low, mixed)
    except ValueError as exc:
        raise PolicyError(str(exc)) from None
    policies = {"block": fsdp_mp_policy(policy), "batch norm": batch_norm_mp_policy()}
    policies["root"], fp32_policy = policies["block"], _fp32_mp_policy(cast_forward_inputs=not mixed)
    plan: list[ShardGroup] = []
    claimed: set[int] = set()
    for name, role in groups:
        params = {id(p) for p in model.get_submodule(name).parameters()} - claimed
        claimed |= params
        role = "autocast fp32" if name in extra and role == "block" else role
        fp32 = role in ("block", "root") and params & keep32
        plan.append(ShardGroup(name, fp32_policy if fp32 else policies.get(role, fp32_policy), role))
    return plan


def fsdp_groups(
    model: torch.nn.Module,
    blocks: list[torch.nn.Module],
    islands: list[str],
    low_precision: bool,
    mixed: bool = False,
) -> list[tuple[str, str]]:
    """The fully_shard calls for model, in order (deepest first, the root "" last), each as (module
    name, role): "block" and "root" (the policy's MixedPrecisionPolicy), "keep_fp32" and "block in
    keep_fp32" (fp32 params and inputs), "batch norm" under a low-precision policy (fp32 params, the
    inputs left as they come: BatchNorm takes half inputs with fp32 weights and statistics). blocks:
    the repeated modules; islands: the keep_fp32 module names. A tied weight is sharded by one group:
    a block that would split a tie is left to the group around it. A keep_fp32 module that would
    raises where that splits the tie's dtype (*-true: one side half, the island fp32); under *-mixed
    (``mixed``) every weight is fp32 as on one device and autocast casts it per op, so the island is
    left to the group around it, which the caller gathers in fp32. Plain torch: mixprec's
    sharding_plan and the fsdp2 export (which pastes it) share this plan."""
    names = {id(module): name for name, module in model.named_modules()}

    def inside(name: str, group: str) -> bool:
        return not group or name == group or name.startswith(group + ".")

    candidates: dict[str, str] = {}
    for block in blocks:
        name = names[id(block)]
        candidates[name] = "block in keep_fp32" if any(inside(name, i) for i in islands) else "block"
    for name in islands:
        candidates.setdefault(name, "keep_fp32")
    for name, module in model.named_modules():
        norm = isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        if low_precision and norm and next(module.parameters(), None) is not None:
            candidates[name] = "batch norm"
    owners: dict[int, list[str]] = {}  # every module holding each parameter directly: ties have two
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    claimed: set[int] = set()  # deepest first: each call takes the params no deeper group took
    groups: list[tuple[str, str]] = []
    for name in sorted(candidates, key=lambda n: -n.count(".")):
        params = {id(p) for p in model.get_submodule(name).parameters()} - claimed
        if not params:
            continue
        outside = sorted({o for p in params for o in owners[p] if not inside(o, name)})
        if outside and candidates[name] == "keep_fp32" and not mixed:
            raise ValueError(
                f"keep_fp32 module {name!r} shares a parameter with {outside[0]!r} (tied weights); FSDP2 "
                "all-gathers a tied parameter once, in one dtype, so it cannot be fp32 in one and "
                f"low precision in the other: untie them, or drop {name!r} from keep_fp32."
            )
        if not outside:
            claimed |= params
            groups.append((name, candidates[name]))
    return [*groups, ("", "root")]


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
    works on the sharded DTensor gradients and every rank skips the same steps. Under *-mixed
    every op runs in the dtypes it runs in on one device (norms, embeddings and the residual
    stream stay fp32; tests/distributed/test_fsdp2_numerics.py); what differs is only the order
    of the gradient sums over ranks.
    """
    import torch.distributed as dist

    if not isinstance(policy, Policy):
        raise PolicyError(f"shard_model takes a mixprec Policy, got {type(policy).__name__}.")
    fully_shard, _, FSDPModule = fsdp_api()
    if isinstance(model, FSDPModule):
        raise PolicyError("The model is already sharded with fully_shard; shard it once.")
    check_prepared(model, policy, "shard_model", check_device=False)
    require_initialized("shard_model")
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
