"""The ``fsdp2`` target: plain PyTorch plus ``fully_shard`` with the policy's MixedPrecisionPolicy.

The plan of :func:`mixprec.distributed.shard_model`, pasted: its groups come from the same
:func:`mixprec.distributed.fsdp2.fsdp_groups` (run by the frameworks tier on one gloo rank): each
repeated block and the root sharded with :func:`mixprec.distributed.fsdp_mp_policy`'s dtypes, each
fp32 island in a group of its own with an fp32 policy, and under a low-precision policy each
BatchNorm in one with :func:`mixprec.distributed.fsdp2.batch_norm_mp_policy` (fp32 weights and, as
``Policy.prepare`` keeps them under *-true, fp32 running statistics; its inputs not cast, so it
returns the dtype it is given, as on one device). Under *-mixed, as in ``sharding_plan``, only
Linear and conv weights are gathered in the compute dtype and no group casts its inputs (autocast
does): every module :func:`mixprec.distributed.common.autocast_fp32_params` (pasted too) finds
joins the groups with the fp32 policy, and a block or the root still holding such a parameter (a
tied embedding) is fp32, so every op runs in the dtypes it runs in on one device (run on one gloo
rank against one device, bit for bit, by the tests). ``fully_shard`` refuses
non-contiguous parameters (``FSDP does not support non-contiguous parameters``), so channels_last
is refused. ``torch.compile`` wraps the model after ``fully_shard``, and torch's fused and foreach
optimizers step the DTensor shards (DTensor has sharding rules for ``_fused_adam(w)_``). Under the
step scope the plain-PyTorch ``train_step`` is compiled around the sharded model: FSDP2's hooks are
``torch._dynamo.disable``'d and run eagerly between the graphs, and the optimizer step compiles over
the DTensor shards (run on one gloo rank by the tests). With gradient accumulation the loop calls
``model.set_requires_gradient_sync(False)`` on all but the last micro-batch of each step
(``FSDPModule.set_requires_gradient_sync`` sets every group's ``reduce_grads``, recursively): the
groups' post-backward then skips the reduce-scatter and keeps the unsharded gradients, upcast to
``reduce_dtype`` (``FSDPParam.to_accumulated_grad_if_needed``), and the last micro-batch adds its
own and reduce-scatters the sum (``FSDPParamGroup.post_backward``, torch 2.14). FSDP2 cannot mix
dtypes in one unit (pytorch#156784), so each fp32 island costs a unit of its own: given the model, the
header counts the units the keep_fp32 set adds (:func:`mixprec.distributed.fsdp2.keep_fp32_units`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from mixprec.distributed.common import autocast_fp32_params
from mixprec.distributed.fsdp2 import fsdp_groups, keep_fp32_units
from mixprec.errors import PolicyError, UsageError
from mixprec.exports.facts import Facts
from mixprec.exports.prepare import prepare_lines
from mixprec.exports.pytorch import PyTorchTarget, plain_loop
from mixprec.exports.target import Contract, Refusal
from mixprec.exports.text import DTYPE_CODE, DTYPE_SHORT, comment, py


class FSDP2Target(PyTorchTarget):
    """FSDP2: the plain-PyTorch export with fully_shard between preparation and optimizer."""

    name = "fsdp2"
    writes_fp8 = False  # torchao float8 with FSDP2 (fp8 all-gather) is not checked yet: refused
    title = "FSDP2 (fully_shard)"
    aliases = ("fsdp", "fully_shard")
    optimizer_after = "fully_shard"

    def stack_refusal(self, facts: Facts) -> Refusal | None:
        if facts.channels_last:
            return Refusal(
                "fully_shard refuses non-contiguous parameters ('FSDP does not support non-contiguous"
                " parameters'), and channels_last convolution weights are non-contiguous",
                f"'{facts.name}' without channels_last under FSDP2, or channels_last with the 'pytorch'"
                " export"
                " under DistributedDataParallel",
            )
        return None

    def contract(self, facts: Facts) -> Contract:
        contract = super().contract(facts)
        low = facts.low
        if facts.mixed is not None:
            short = DTYPE_SHORT[facts.mixed]
            contract.runs.append(
                f"MixedPrecisionPolicy(param_dtype={short}, reduce_dtype=fp32, cast_forward_inputs=False):"
                f" Linear and convolution weights all-gathered in {short} (autocast casts them anyway),"
                " gradients reduce-scattered in fp32 into the fp32 sharded master weights. Every other"
                " parameter (norms, embeddings) is all-gathered in fp32, in a group of its own, or with"
                " its block's or the root's group made fp32 where it cannot be split off (a weight tied"
                " to the head, a keep_fp32 head tied to the embedding). Inputs are not cast: the autocast"
                " stays and does the casting, so every op"
                " runs in the dtypes it runs in on one device (norms, embeddings and the residual stream"
                " in fp32)."
            )
        elif low is not None:
            short = DTYPE_SHORT[low]
            contract.runs.append(
                f"MixedPrecisionPolicy(param_dtype={short}, reduce_dtype=fp32): the model is {short} before"
                f" sharding, so the sharded parameters and the optimizer step stay {short} (no fp32 master"
                " weights, as the policy says); the ranks' gradients are summed in fp32."
            )
        else:
            contract.runs.append(
                "MixedPrecisionPolicy(fp32, fp32): fp32 shards, all-gathers, reduce-scatters."
            )
        if facts.scaler is not None:
            contract.runs.append(
                "The GradScaler works on FSDP2's DTensor gradient shards: DTensor all-reduces found_inf"
                " inside"
                " its unscale kernel (torch >= 2.5), so every rank skips the same steps; ShardedGradScaler"
                " (made for FSDP1) is not needed."
            )
        if facts.keep:
            contract.runs.append(
                f"{extra_units(facts)} FSDP2 cannot mix dtypes in one unit (pytorch#156784), so each fp32"
                " island is a fully_shard group of its own with an fp32 policy (else the enclosing group"
                " would all-gather its parameters in low precision)"
                + (
                    "; an island tied to a module outside it (a head tied to the embedding) is left to the"
                    " group around both, gathered in fp32: every weight is fp32 under *-mixed, as on one"
                    " device."
                    if facts.mixed is not None
                    else "; one tied to a module outside it is refused (fp32 on one side, half on the other)."
                )
            )
        if low is not None:
            statistics = " and running statistics" if facts.true is not None else ""
            contract.runs.append(
                f"BatchNorm: fp32 weights{statistics}, in a fully_shard group of its own gathered in fp32"
                " (the block's group would gather them in low precision next to its fp32 running"
                " statistics); its inputs are not cast: it returns the dtype it is given, as on one device."
            )
        if facts.compiles_step:
            contract.runs.append(
                "FSDP2's hooks (the all-gather before forward, the reduce-scatter after backward) are"
                " dynamo-disabled in torch.distributed.fsdp: they run eagerly between the compiled"
                " graphs; the compiled optimizer step updates each rank's DTensor shards."
            )
        if facts.accumulates:
            contract.runs.append(
                f"model.set_requires_gradient_sync(False) on the first {facts.accumulation_steps - 1} of"
                f" every {facts.accumulation_steps} micro-batches: FSDP2 skips their gradient"
                " reduce-scatter and keeps the unsharded gradients (in fp32) until the last one, which"
                " reduce-scatters the sum once per optimizer step. That holds a full unsharded gradient"
                " per rank between the micro-batches; set_requires_gradient_sync(True) throughout trades it"
                " for a reduce-scatter per micro-batch, with the same sums in another order."
            )
        if facts.optimizer in ("fused", "foreach"):
            contract.runs.append(
                f"The {facts.optimizer} optimizer kernels step each rank's DTensor shards (DTensor shards"
                " them as the parameters are)."
            )
        contract.fill_in += " model.layers: your repeated blocks (transformer layers, ResNet stages, ...)."
        launch = 'torch.distributed.init_process_group("gloo")'
        if facts.device_type == "cuda":
            launch = 'torch.distributed.init_process_group("nccl") and torch.cuda.set_device(local_rank)'
        contract.launch = f"torchrun --nproc_per_node N train.py; this code runs after {launch}."
        return contract

    def read_model(self, facts: Facts, model: nn.Module | None) -> Facts:
        """With ``model``, the fully_shard units the keep_fp32 set adds, counted on it with the
        blocks the code takes (``model.layers``, else those :func:`~mixprec.distributed.find_blocks`
        finds). A keep_fp32 module that splits a tie under *-true leaves them uncounted: the code
        raises that at its plan, with the reason."""
        if model is None or not facts.keep:
            return facts
        if not isinstance(model, nn.Module):
            raise UsageError(
                f"The fsdp2 target counts the fully_shard units of keep_fp32 on a torch.nn.Module, got"
                f" model={type(model).__name__}; pass the model, or no model."
            )
        layers = getattr(model, "layers", None)
        blocks = None
        if isinstance(layers, (nn.ModuleList, nn.Sequential)):
            names = {id(module): name for name, module in model.named_modules()}
            blocks = [names[id(block)] for block in layers]
        try:
            units = keep_fp32_units(model, facts.config, blocks=blocks)
        except PolicyError:
            return facts
        return replace(facts, keep_fp32_units=units)

    def training_loop(self, facts: Facts) -> list[str]:
        if not facts.accumulates:
            return plain_loop(facts)
        sync = [
            "    # FSDP2 reduce-scatters the gradients on the last micro-batch of each step only",
            "    model.set_requires_gradient_sync(i % accumulation_steps == 0)",
        ]
        return plain_loop(facts, sync)

    def third_party(self, facts: Facts) -> list[str]:
        return [
            "import torch",
            "from torch.distributed.device_mesh import init_device_mesh",
            "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
        ]

    def prepare(self, facts: Facts) -> list[str]:
        param_dtype = DTYPE_CODE[facts.low] if facts.low is not None else "torch.float32"
        mixed = facts.mixed is not None
        policies = {"block": "mp_policy"}
        if mixed:  # autocast casts the inputs, as on one device: a block's fp32 input stays fp32
            lines = [
                "mp_policy = MixedPrecisionPolicy(  # autocast casts the inputs, as on one device",
                f"    param_dtype={param_dtype}, reduce_dtype=torch.float32, cast_forward_inputs=False",
                ")",
                "fp32_policy = MixedPrecisionPolicy(",
                "    param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False",
                ")",
            ]
        else:
            lines = [
                f"mp_policy = MixedPrecisionPolicy(param_dtype={param_dtype}, reduce_dtype=torch.float32)"
            ]
        if facts.keep and not mixed:
            lines.append(
                "fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)"
            )
        if facts.keep:
            policies |= {"keep_fp32": "fp32_policy", "block in keep_fp32": "fp32_policy"}
        if facts.low is not None:
            lines += [
                "batch_norm_policy = MixedPrecisionPolicy(  # fp32 weights, the inputs as they come",
                "    param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False",
                ")",
            ]
            policies["batch norm"] = "batch_norm_policy"
        if mixed:
            policies["root"] = "mp_policy"
        islands = "list(islands)" if facts.keep else "[]"
        pasted: list[Callable[..., Any]] = [fsdp_groups, autocast_fp32_params] if mixed else [fsdp_groups]
        return [
            *(line for f in pasted for line in ["", "", *inspect.getsource(f).splitlines()]),
            "",
            "",
            *lines,
            *prepare_lines(facts, move=False),
            *comment(
                "The fully_shard calls of mixprec's shard_model, deepest first, the root last:"
                + (
                    " each module whose parameters autocast does not cast (norms, embeddings: all but"
                    " Linear and conv) in an fp32 group of its own,"
                    if mixed
                    else (" BatchNorm in an fp32 group of its own," if facts.low is not None else "")
                )
                + (" fp32 islands too," if facts.keep else "")
                + " each repeated block in one."
            ),
            "policies = {",
            *(f"    {py(role)}: {name}," for role, name in policies.items()),
            "}",
            *comment(
                "One rank per process on the exported device, as shard_model shards (fully_shard's own"
                " default mesh is the accelerator's, CUDA wherever there is one)."
            ),
            "mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))",
            "blocks = list(model.layers)  # yours: your repeated blocks (transformer layers, ResNet stages)",
            *(self._autocast_fp32_groups(facts) if mixed else []),
            f"groups = fsdp_groups(model, blocks, {islands}, low_precision={facts.low is not None}"
            + (", mixed=True)" if mixed else ")"),
            *(
                [
                    *comment(
                        "Each group's policy, before fully_shard replaces the parameters: fp32 for the"
                        " modules added above, and for a block or the root still holding such a parameter"
                        " (fsdp_groups leaves a tied weight, e.g. an embedding tied to the head, to the"
                        " group around both)."
                    ),
                    "claimed, group_policies = set(), {}",
                    "for name, role in groups:",
                    "    params = {id(p) for p in model.get_submodule(name).parameters()} - claimed",
                    "    claimed |= params",
                    '    fp32 = role in ("block", "root") and params & fp32_ids',
                    "    group_policies[name] = fp32_policy if fp32 else policies[role]",
                    "for name, _ in groups[:-1]:  # the last is the root's, below",
                    "    fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=group_policies[name])",
                    'mp_policy = group_policies[""]  # the root\'s: fp32 if it holds such a parameter',
                ]
                if mixed
                else [
                    "for name, role in groups[:-1]:  # the last is the root's, below",
                    "    fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policies[role])",
                ]
            ),
            "fully_shard(model, mesh=mesh, mp_policy=mp_policy)",
        ]

    def _autocast_fp32_groups(self, facts: Facts) -> list[str]:
        """*-mixed: the modules :func:`autocast_fp32_params` finds join the blocks (as sharding_plan
        adds them), and fp32_ids collects their parameters for the policies below."""
        outside = [  # the fp32 islands have their own fp32 groups
            'extra = [n for n in extra if not any(n == i or n.startswith(i + ".") for i in islands)]'
        ]
        outside = outside if facts.keep else []
        return [
            *comment(
                "Autocast casts only Linear and conv weights: every other parameter (norms, embeddings)"
                " is gathered in fp32 and reaches its ops in fp32, as on one device."
            ),
            "fp32_params = autocast_fp32_params(model)",
            "fp32_ids = set().union(*fp32_params.values())",
            *(
                [
                    "# an island tied to a module outside it (a head tied to the embedding) is left to the",
                    "# group around both: that group is gathered in fp32, as the island runs on one device",
                    "fp32_ids |= {id(p) for island in islands.values() for p in island.parameters()}",
                ]
                if facts.keep
                else []
            ),
            "extra = [name for name in fp32_params if name and model.get_submodule(name) not in blocks]",
            *outside,
            "blocks += [model.get_submodule(name) for name in extra]",
        ]


def extra_units(facts: Facts) -> str:
    """The header's sentence on what the keep_fp32 set costs under FSDP2: the units it adds to the
    plan without it, counted on the model where the export was given one."""
    keep, n = py(facts.keep), facts.keep_fp32_units
    if n is None:
        anyway = ", a norm or an embedding (a unit anyway under *-mixed)" if facts.mixed is not None else ""
        return (
            f"keep_fp32 {keep}: up to one extra fully_shard unit per module it matches (none for a block"
            f" or a module inside one{anyway}), each one more all-gather in forward, one in backward and"
            ' one more reduce-scatter per step, over the same bytes; export(candidate, "fsdp2",'
            " model=model) counts them on your model."
        )
    if n == 0:
        return (
            f"keep_fp32 {keep}: no extra fully_shard unit on your model (its modules are blocks, lie inside"
            " them, are units of their own anyway or are left to the group around a tie)."
        )
    units = "1 extra fully_shard unit" if n == 1 else f"{n} extra fully_shard units"
    calls = "all-gather" if n == 1 else "all-gathers"
    return (
        f"keep_fp32 {keep}: {units} on your model ({n} more {calls} in forward, {n} in backward and {n}"
        f" more reduce-scatter{'' if n == 1 else 's'} per step, over the same bytes)."
    )
