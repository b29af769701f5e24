"""The ``fsdp2`` target: plain PyTorch plus ``fully_shard`` with the policy's MixedPrecisionPolicy.

The same plan as :func:`mixprec.distributed.shard_model` (run by the frameworks tier on one gloo
rank): each repeated block and the root sharded with :func:`mixprec.distributed.fsdp_mp_policy`'s
dtypes, each fp32 island in a group of its own with an fp32 policy. ``fully_shard`` refuses
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
own and reduce-scatters the sum (``FSDPParamGroup.post_backward``, torch 2.14).
"""

from __future__ import annotations

from mixprec.exports.base import (
    DTYPE_CODE,
    DTYPE_SHORT,
    Contract,
    Facts,
    Refusal,
    comment,
    helper_names,
    loop_helper_names,
    prepare_lines,
)
from mixprec.exports.pytorch import PyTorchTarget, plain_loop


class FSDP2Target(PyTorchTarget):
    """FSDP2: the plain-PyTorch export with fully_shard between preparation and optimizer."""

    name = "fsdp2"
    writes_fp8 = False  # torchao float8 with FSDP2 (fp8 all-gather) is not checked yet: refused
    title = "FSDP2 (fully_shard)"
    aliases = ("fsdp", "fully_shard")
    optimizer_after = "fully_shard"

    def refusal(self, facts: Facts) -> Refusal | None:
        refused = super().refusal(facts)
        if refused is not None:
            return refused
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
                f"MixedPrecisionPolicy(param_dtype={short}, reduce_dtype=fp32): parameters all-gathered in"
                f" {short}, inputs cast (cast_forward_inputs), gradients reduce-scattered in fp32 into the"
                " fp32"
                " sharded master weights. The autocast stays, so the ops autocast keeps in fp32 (softmax,"
                " norms, losses) stay fp32 as on one device."
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
                "fp32 islands: a fully_shard group of their own with an fp32 policy (else the enclosing group"
                " would all-gather their parameters in low precision)."
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

    def training_loop(self, facts: Facts) -> list[str]:
        if not facts.accumulates:
            return plain_loop(facts)
        sync = [
            "    # FSDP2 reduce-scatters the gradients on the last micro-batch of each step only",
            "    model.set_requires_gradient_sync(i % accumulation_steps == 0)",
        ]
        return plain_loop(facts, sync)

    def third_party(self, facts: Facts) -> list[str]:
        return ["import torch", "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard"]

    def snippet_names(self, facts: Facts) -> list[str]:
        return helper_names(facts, batch_norm=False) + loop_helper_names(facts)

    def prepare(self, facts: Facts) -> list[str]:
        param_dtype = DTYPE_CODE[facts.low] if facts.low is not None else "torch.float32"
        lines = [f"mp_policy = MixedPrecisionPolicy(param_dtype={param_dtype}, reduce_dtype=torch.float32)"]
        if facts.keep:
            lines.append(
                "fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)"
            )
        # BatchNorm is cast with the model here: a block's group gathers every parameter in one dtype
        lines += prepare_lines(facts, move=False, batch_norm=False)
        if facts.keep:
            lines += [
                *comment(
                    "fp32 islands first, deepest first, each in a group of its own with the fp32 policy."
                ),
                'for name in sorted(islands, key=lambda n: -n.count(".")):',
                "    fully_shard(islands[name], mp_policy=fp32_policy)",
            ]
        return [
            *lines,
            "for block in model.layers:  # yours: your repeated blocks (transformer layers, ResNet stages,"
            " ...)",
            "    fully_shard(block, mp_policy=mp_policy)",
            "fully_shard(model, mp_policy=mp_policy)",
        ]
