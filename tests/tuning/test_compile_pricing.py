"""A compile already in Inductor's cache is priced from what it cost here before: a budget that
could not pay a first compile pays a cached one (planted step times, tests/tuning/scripted.py)."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.frameworks import register_framework, unregister_framework
from mixprec.hardware.device import detect
from mixprec.measure.compile_cache import CompileCosts, cost_key

from .scripted import Planted, PlantedFramework

SECONDS = {"fp32": 0.20, "bf16-mixed": 0.10, "bf16-mixed+compile": 0.07}


@pytest.fixture(autouse=True)
def planted_framework(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # the measuring order is not what this tests: no format probe inside the small budget
    monkeypatch.setattr("mixprec.tuning.search.ordered", lambda candidates, info: list(candidates))
    register_framework(PlantedFramework())
    yield
    unregister_framework("planted")


def _tune():
    # 40 s: room for the eager stages on a busy machine (CI runs a test beside this one), while the
    # cold prior (20 s, paid 1.5 times over, plus a check) does not fit the share compiling may take
    return mixprec.tune(Planted(SECONDS, jitter=0.01), budget_s=40, steps=4, warmup=1, check_steps=2)


def test_a_cached_compile_is_priced_cheap_and_tried_where_a_cold_one_is_not(tmp_path):
    cold = _tune()
    assert cold.recommendation.candidate.label == "bf16-mixed"
    assert any("bf16-mixed+compile (the budget could not pay" in n for n in cold.notes), cold.notes
    # the same candidate compiled here before (cold, then from the cache), its artefacts kept
    (tmp_path / "inductor" / "fxgraph").mkdir(parents=True)
    (tmp_path / "inductor" / "fxgraph" / "entry").write_text("x")
    key = cost_key(
        "planted", cold.workload, 8, "bf16-mixed+compile", detect("cpu").name, torch.get_num_threads()
    )
    CompileCosts().record(key, 30.0)
    CompileCosts().record(key, 1.0)
    warm = _tune()
    assert warm.recommendation.candidate.label == "bf16-mixed+compile"
    assert not any("bf16-mixed+compile (the budget could not pay" in n for n in warm.notes), warm.notes
