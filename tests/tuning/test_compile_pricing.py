"""A compile already in Inductor's cache is priced from what it cost here before: a budget that
could not pay a first compile pays a cached one (planted step times, tests/tuning/scripted.py)."""

from __future__ import annotations

import re

import pytest
import torch

import mixprec
from mixprec.frameworks import register_framework, unregister_framework
from mixprec.hardware.device import detect
from mixprec.measure.compile_cache import CompileCosts, cost_key

from .scripted import Planted, PlantedFramework, planted_clock  # noqa: F401 (a fixture)

SECONDS = {"fp32": 0.20, "bf16-mixed": 0.10, "bf16-mixed+compile": 0.07}

pytestmark = pytest.mark.usefixtures("planted_clock")


class CachedPlanted(PlantedFramework):
    """The planted backend with compiled artefacts that outlive a process, as Inductor's do."""

    compiles_cached = True


@pytest.fixture(autouse=True)
def planted_framework(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # the measuring order is not what this tests: no format probe inside the small budget
    monkeypatch.setattr("mixprec.tuning.order.ordered", lambda candidates, info: list(candidates))
    register_framework(CachedPlanted())  # Inductor's caches are what this module is about
    yield
    unregister_framework("planted")


def _tune(budget_s: float = 30):
    # 30 s on the planted clock: room for the eager stages (a few planted seconds), while the cold
    # prior (20 s, paid 1.5 times over to measure it, plus a check) does not fit the share compiling
    # may take (85% of the budget)
    return mixprec.tune(Planted(SECONDS, jitter=0.01), budget_s=budget_s, steps=4, warmup=1, check_steps=2)


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
    CompileCosts().record(key, 16.0)  # cold: its check compiles from the cache at half that
    CompileCosts().record(key, 1.0)
    warm = _tune()
    assert warm.recommendation.candidate.label == "bf16-mixed+compile", (
        warm.notes,
        warm.phases,
        [(c.label, c.reason) for c in warm.ranked],
    )
    assert not any("bf16-mixed+compile (the budget could not pay" in n for n in warm.notes), warm.notes


def test_a_first_compile_is_gated_on_measuring_it_and_checked_at_its_measured_cost():
    """A first compile's cost is the prior's guess (20 s). Gated on the guess for its measurement
    and its check's compiles alike (4.5x the prior), the default tune of the nanoGPT-style GPT on the
    EPYC, slowed by other work beside it, compiled nothing: 73 s left for compiling against a priced
    112 s, where its step compiles in 5-12 s and runs 1.2x faster than the eager pick. Now measuring
    it is what must fit (1.5x the prior and the eager part of its check), and its check is priced
    from the compile it measured."""
    result = _tune(budget_s=80)  # compiling may take up to 68 s: 30 s fits, 90 s does not
    rows = {r.label: r for r in result.bench.rows if not r.baseline_repeat}
    assert rows["bf16-mixed+compile"].status == "ok", result.notes
    checked = {c.candidate.label for c in result.check.candidates}
    assert "bf16-mixed+compile" in checked  # its measured compile (planted: none) priced its check
    assert result.recommendation.candidate.label == "bf16-mixed+compile"


def test_a_compile_predicted_too_far_below_the_best_is_not_started_in_any_family():
    """fp32's family needs no check, so it was compiled whenever the budget seemed to pay, however
    far below the best its prediction: the default tune of ResNet-50 on the EPYC spent 81 s compiling
    fp32+cl+compile-step (predicted 1.40x beside a measured 2.00x) until the budget stopped it."""
    seconds = {"fp32": 0.20, "fp32+compile": 0.19, "bf16-mixed": 0.08, "bf16-mixed+compile": 0.07}
    result = mixprec.tune(Planted(seconds, jitter=0.01), budget_s=80, steps=4, warmup=1, check_steps=2)
    measured = {r.label for r in result.bench.rows if r.status == "ok"}
    assert "bf16-mixed+compile" in measured, result.notes
    assert "fp32+compile" not in measured, result.notes
    assert any("fp32+compile (too far below the best" in n for n in result.notes), result.notes


def test_a_compile_never_made_here_is_priced_from_this_models_other_compiles_here(tmp_path):
    """Only a compile nothing is known of is gated on measuring it alone, at the prior. Where this
    model's other candidates compiled here before, a new one compiles cold like their first
    compiles did: priced by the longest of those, it must fit with its check, as a known one must."""
    first = _tune(budget_s=80)
    key = cost_key("planted", first.workload, 8, "fp32+compile", detect("cpu").name, torch.get_num_threads())
    CompileCosts().record(key, 45.0)  # a sibling's first compile here: 45 s (and a 22 s check)
    result = _tune(budget_s=80)  # compiling may take up to 68 s: 1.5 x 45 s and a check do not fit
    rows = {r.label: r for r in result.bench.rows if not r.baseline_repeat}
    assert "bf16-mixed+compile" not in rows or rows["bf16-mixed+compile"].status != "ok", result.notes
    assert any(
        "bf16-mixed+compile (the budget could not pay" in n
        and "first compile of this model's candidates here" in n
        for n in result.notes
    ), result.notes


@pytest.mark.parametrize("cached", [True, False])
def test_a_compiled_check_after_its_speed_run_is_priced_from_the_cache(cached):
    """The nanoGPT's bf16-true+compile-step on the AMX Xeon compiled in 60 s and was left unchecked:
    its check was priced at 3x that compile (194 s) against 49 s left, where its check, compiling
    from Inductor's cache, took 31 s. Its check is now priced at half its compile where the backend
    keeps what it compiled, and at 1.5x (the cold check measured there: 1.3x) where it does not."""
    unregister_framework("planted")
    register_framework(CachedPlanted() if cached else PlantedFramework())
    seconds = {"fp32": 0.20, "bf16-mixed": 0.10, "bf16-mixed+compile": 0.05}
    result = mixprec.tune(
        Planted(seconds, jitter=0.01, compile_s=60.0), budget_s=150, steps=4, warmup=1, check_steps=2
    )
    rows = {r.label: r for r in result.bench.rows if not r.baseline_repeat}
    assert rows["bf16-mixed+compile"].status == "ok", result.notes
    checked = {c.candidate.label for c in result.check.candidates}
    if cached:
        assert "bf16-mixed+compile" in checked, result.notes
        assert result.recommendation.candidate.label == "bf16-mixed+compile"
    else:
        assert "bf16-mixed+compile" not in checked, result.notes
        row = next(c for c in result.ranked if c.label == "bf16-mixed+compile")
        # the row says what its check would cost, its compile included (it said the eager part: 14 s)
        said = re.fullmatch(
            r"numerics not checked: the budget ended first \(about (\d+) s more would check it\)", row.reason
        )
        assert said and 90 <= int(said[1]) < 100, row.reason


def test_a_compile_the_budget_cut_off_is_priced_at_least_that_next_time():
    """The default ResNet-50 tune on the EPYC started its step's compile, priced at the 20 s prior,
    and the budget cut it off ~75 s later: nothing measured, nothing learned, so the next tune did
    the same (two runs in a row, a quarter of each budget). The cut is kept: the next tune prices
    that compile at what it had taken and spends its budget elsewhere."""
    seconds = {"fp32": 0.20, "bf16-mixed": 0.10, "bf16-mixed+compile": 0.05}
    planted = Planted(seconds, jitter=0.01, compile_s=300.0)
    first = mixprec.tune(planted, budget_s=80, steps=4, warmup=1, check_steps=2)
    assert any("bf16-mixed+compile (the budget ended while it compiled)" in n for n in first.notes), (
        first.notes
    )
    key = cost_key(
        "planted", first.workload, 8, "bf16-mixed+compile", detect("cpu").name, torch.get_num_threads()
    )
    cut = CompileCosts().price(key)
    assert cut is not None and "cut off after" in cut.basis, cut
    # its own session's time (the 300 s compile, its few planted steps), not the sweep's, which
    # opened strict fp32 first (~1 s of planted steps; a real model's opening was seconds more)
    assert 300.0 <= cut.seconds < 300.5, (cut, first.phases)
    second = mixprec.tune(planted, budget_s=80, steps=4, warmup=1, check_steps=2)
    assert not any("the budget ended while it compiled" in n for n in second.notes), second.notes
    assert any(
        "bf16-mixed+compile (the budget could not pay" in n and "cut off after" in n for n in second.notes
    ), second.notes
    assert second.phases["compile"] < 1.0, second.phases
