"""Carry a precision policy over to DDP and FSDP2 (``fully_shard``), using torch.distributed as it is.

mixprec builds no distributed runtime of its own. This package answers, for every policy, what
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

from mixprec.distributed.checks import StatsMismatchError, assert_stats_agree
from mixprec.distributed.common import WRAPPERS
from mixprec.distributed.ddp import DDPConfig, apply_ddp, ddp_config
from mixprec.distributed.fsdp2 import (
    ShardGroup,
    find_blocks,
    fsdp_mp_policy,
    keep_fp32_units,
    shard_model,
    sharding_plan,
)
from mixprec.distributed.support import support

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
    "keep_fp32_units",
    "shard_model",
    "sharding_plan",
    "support",
]
