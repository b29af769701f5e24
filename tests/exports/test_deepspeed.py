"""The deepspeed export against the real DeepSpeed (the frameworks extra): CPU accelerator, one gloo
rank from tests/exports/conftest.one_rank."""

from __future__ import annotations

import pytest
import torch
from harness import CASES, Net, require, run_case, run_deepspeed

require("deepspeed")

import deepspeed  # noqa: E402

pytestmark = [pytest.mark.frameworks, pytest.mark.usefixtures("one_rank")]

# tf32: a CUDA math mode. fp16-true: DeepSpeed's loss scaler needs its fp16 section (fp32 master
# weights) or torch_autocast (fp32 parameters).
REFUSED = {"tf32", "fp16-true"}


@pytest.mark.parametrize("case", CASES)
def test_export_runs_the_policy(case, tmp_path):
    run_case("deepspeed", case, REFUSED, lambda config: run_deepspeed(config, tmp_path))


def _initialize(model: torch.nn.Module, config: dict) -> object:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def test_without_a_batch_size_initialize_asserts():
    with pytest.raises(AssertionError, match="train_batch_size"):
        _initialize(Net(), {"gradient_clipping": 1.0})


def test_channels_last_before_initialize_crashes_its_broadcast():
    """Why the export applies channels_last after initialize()."""
    model = Net().to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="stride"):
        _initialize(model, {"train_micro_batch_size_per_gpu": 1})


def test_the_bf16_section_is_not_bf16_mixed():
    """Why bf16-mixed is torch_autocast: the "bf16" section casts the parameters and does not autocast."""
    model = Net()
    engine = _initialize(model, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}})
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not engine.torch_autocast_enabled()
