"""Compiles priced from what they cost on this machine before, and Inductor's cache in mixprec's."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from mixprec.errors import CacheWarning
from mixprec.measure import compile_cache
from mixprec.measure.compile_cache import WARM_SHARE, CompileCosts, cost_key


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    # set, then deleted: monkeypatch records the variable's original state only when it changes it,
    # so it is put back after the test whatever use_inductor_cache() wrote meanwhile
    monkeypatch.setenv(compile_cache.ENV, "unset-by-the-fixture")
    monkeypatch.delenv(compile_cache.ENV)
    return tmp_path


def _artefacts(cache):
    (cache / "inductor" / "fxgraph").mkdir(parents=True)
    (cache / "inductor" / "fxgraph" / "entry").write_text("x")


KEY = cost_key("torch", "gpt", 8, "bf16-mixed+compile-step", "AMD EPYC", 2)


def test_a_compile_already_in_the_cache_is_priced_cheap(cache):
    _artefacts(cache)
    CompileCosts().record(KEY, 40.0)  # the first (cold) compile
    price = CompileCosts().price(KEY)  # a later run reads it back
    assert price is not None and price.seconds == pytest.approx(40.0 * WARM_SHARE)
    assert "40.0 s" in price.basis
    CompileCosts().record(KEY, 2.5)  # then compiled from the cache: its own figure from now on
    assert CompileCosts().price(KEY).seconds == pytest.approx(2.5)


def test_one_slow_warm_compile_does_not_raise_the_price_a_majority_does(cache):
    # The EPYC: ResNet-50's bf16-mixed+cl+compile-step compiled from the cache in 9.7 s, then once in
    # 56.6 s on a busy machine; priced at 56.6 s, the next quiet tune could not pay to compile it.
    _artefacts(cache)
    for seconds in (18.9, 9.7, 56.6):
        CompileCosts().record(KEY, seconds)
    assert CompileCosts().price(KEY).seconds == pytest.approx(9.7)
    CompileCosts().record(KEY, 14.0)
    CompileCosts().record(KEY, 16.0)  # slower three times out of four: the machine is slower now
    assert CompileCosts().price(KEY).seconds == pytest.approx(14.0)
    for seconds in (10.0, 9.9, 9.6):  # only the last WARM_KEPT count: 9.7 and 56.6 leave
        CompileCosts().record(KEY, seconds)
    assert CompileCosts().price(KEY).seconds == pytest.approx(10.0)  # of 14, 16, 10, 9.9, 9.6
    CompileCosts().record(KEY, 9.5)  # 14 leaves
    assert CompileCosts().price(KEY).seconds == pytest.approx(9.9)


def test_a_warm_price_above_the_cold_compile_is_capped_at_it(cache):
    # A price the budget never pays is never measured again to correct it.
    _artefacts(cache)
    for seconds in (18.9, 56.6, 60.0):
        CompileCosts().record(KEY, seconds)
    price = CompileCosts().price(KEY)
    assert price.seconds == pytest.approx(18.9)
    assert "18.9 s" in price.basis and "56.6 s" in price.basis


def test_a_file_from_before_the_warm_history_prices_at_its_warm_compile(cache):
    _artefacts(cache)
    entry = {"cold_s": 18.9, "warm_s": 56.6}
    (cache / "compile_costs.json").write_text(
        f'{{"version": 1, "entries": {{"{KEY}": {json.dumps(entry)}}}}}'
    )
    assert CompileCosts().price(KEY).seconds == pytest.approx(18.9)  # capped at the cold compile
    CompileCosts().record(KEY, 9.7)
    assert CompileCosts().price(KEY).seconds == pytest.approx(9.7)  # the lower of 56.6 and 9.7


def test_no_price_for_a_compile_never_seen_or_whose_artefacts_are_gone(cache):
    CompileCosts().record(KEY, 40.0)
    assert CompileCosts().price(KEY) is None  # no Inductor artefacts: it would compile cold
    _artefacts(cache)
    assert (
        CompileCosts().price(cost_key("torch", "gpt", 16, "bf16-mixed+compile-step", "AMD EPYC", 2)) is None
    )


def test_a_compile_the_budget_cut_off_prices_it_at_least_that_until_one_finishes(cache):
    CompileCosts().record_cut(KEY, 74.0)  # no artefacts: a cold compile takes at least that
    CompileCosts().record_cut(KEY, 40.0)  # a shorter cut says less
    price = CompileCosts().price(KEY)
    assert price is not None and price.seconds == pytest.approx(74.0), price
    assert "cut off after 74 s" in price.basis
    assert CompileCosts().cold_s(KEY) == pytest.approx(74.0)
    _artefacts(cache)
    CompileCosts().record(KEY, 21.0)  # then one finished, from what the cut ones left
    assert CompileCosts().price(KEY).seconds == pytest.approx(21.0 * WARM_SHARE)
    assert CompileCosts().cold_s(KEY) == pytest.approx(74.0)  # what checking it compiles cold
    CompileCosts().record_cut(KEY, 90.0)  # once one finished, a cut one says the machine was slow
    assert CompileCosts().cold_s(KEY) == pytest.approx(74.0)


def test_a_corrupt_cost_file_reads_as_empty_with_a_warning(cache):
    (cache / "compile_costs.json").write_text("{not json")
    with pytest.warns(CacheWarning, match="unreadable"):
        assert CompileCosts().entries == {}
    (cache / "compile_costs.json").write_text('{"version": 1, "entries": {"k": {"cold_s": "x"}}}')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CompileCosts().entries == {}  # a bad entry is dropped, the file is otherwise fine


def test_inductor_uses_mixprecs_cache_unless_the_user_chose(cache, tmp_path, monkeypatch):
    assert compile_cache.use_inductor_cache() == cache / "inductor"
    assert os.environ[compile_cache.ENV] == str(cache / "inductor")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    assert compile_cache.use_inductor_cache() == tmp_path / "mine"


def test_tunes_inductor_cache_is_its_own_and_the_callers_environment_comes_back(cache):
    with compile_cache.inductor_cache() as used:
        assert used == cache / "inductor" and os.environ[compile_cache.ENV] == str(used)
    assert compile_cache.ENV not in os.environ  # the caller's own torch.compile is left alone


def test_torchs_own_default_written_into_the_environment_is_not_a_choice(cache):
    """Inductor writes its default into the environment the first time it looks its cache up; tune's
    strict-fp32 validation step did, so every compile of a tune went to /tmp/torchinductor_<user>
    (cleared by a reboot) while the prices of those compiles were kept for the next run."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    torchs = cache_dir()  # what any compile in this process does first
    assert os.environ[compile_cache.ENV] == torchs
    with compile_cache.inductor_cache() as used:
        assert used == cache / "inductor" and os.environ[compile_cache.ENV] == str(used)
    assert os.environ[compile_cache.ENV] == torchs  # the caller's environment as it was


@pytest.mark.slow
def test_a_compile_inside_tunes_cache_lands_in_mixprecs_directory(cache):
    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()  # as tune's validation step leaves it
    torch._dynamo.reset()
    with compile_cache.inductor_cache():
        torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.randn(8))
    mixprecs = cache / "inductor"
    assert mixprecs.is_dir() and any(mixprecs.iterdir()), f"nothing compiled into {mixprecs}"
