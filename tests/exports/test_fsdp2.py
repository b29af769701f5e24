"""The fsdp2 export (torch's fully_shard) on one gloo rank, on CPU."""

from __future__ import annotations

import pytest
import torch
from harness import (
    CASES,
    FRAMEWORK_TOLERANCE,
    Net,
    accumulating,
    check_accumulation,
    counting_steps,
    micro_batches,
    run_case,
    run_fsdp2,
    with_sgd,
)
from torch.distributed.fsdp import fully_shard

import mixprec
from mixprec.distributed import shard_model, support
from mixprec.errors import UnsupportedError

pytestmark = pytest.mark.usefixtures("one_rank")

# tf32: a CUDA math mode. channels_last: fully_shard refuses non-contiguous parameters.
REFUSED = {"tf32"} | {c for c in CASES if "+cl" in c}


@pytest.mark.parametrize("case", CASES)
def test_export_runs_the_policy(case):
    run_case("fsdp2", case, REFUSED, run_fsdp2)


def test_fully_shard_refuses_channels_last_parameters():
    """Why channels_last is refused under FSDP2."""
    model = Net().to(memory_format=torch.channels_last)
    with pytest.raises(NotImplementedError, match="non-contiguous parameters"):
        fully_shard(model)


def test_shard_model_refuses_channels_last_with_the_reason():
    policy = mixprec.get_policy("bf16-mixed", device="cpu", channels_last=True)
    verdict = support(policy, "fsdp2")
    assert not verdict and "channels_last" in verdict.reason
    model = policy.prepare(Net())
    with pytest.raises(UnsupportedError, match="non-contiguous"):
        shard_model(model, policy)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_accumulation_steps_once_per_effective_batch(policy):
    """set_requires_gradient_sync on the last of every 3 micro-batches of 4: every optimizer step sees 12
    samples, and the weights are the plain reference loop's (loss / 3 per micro-batch)."""
    source = accumulating(policy)
    with counting_steps():
        run = run_fsdp2(source, loader=micro_batches(), edit=with_sgd)
    check_accumulation(source, run, "fsdp2", **FRAMEWORK_TOLERANCE)
