"""The exports tier: one thread, and one gloo rank for the targets that need a process group."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here trains tiny models: one thread (see tests/conftest.single_thread)."""


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A world of one gloo rank from a FileStore (no TCP port to collide with other runs), with the
    launcher's environment variables that DeepSpeed reads; torn down after the module."""
    store = tmp_path_factory.mktemp("dist") / "store"
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
