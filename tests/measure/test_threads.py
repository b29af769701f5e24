"""The thread count a CPU sweep measures at, and contention seen (scripted timings, no clock)."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.errors import UsageError
from mixprec.measure.config import BenchConfig
from mixprec.measure.threads import ThreadChoice, choose, counts


def test_counts_up_to_the_default():
    assert counts(1) == [1]
    assert counts(2) == [1, 2]
    assert counts(6) == [1, 2, 4, 6]


def test_a_quiet_machine_keeps_the_default():
    choice = choose({1: 0.18, 2: 0.10}, default=2)
    assert choice.threads == 2 and choice.contended is None
    assert "measured at 2 threads, the fastest count now" in choice.reason


def test_a_tie_between_counts_goes_to_fewer_threads():
    # the busy make demo on the EPYC (two spinning processes beside it): 1 thread as fast as 2, and
    # kept at 2 the sweep's steps took three times as long as the probe's
    choice = choose({1: 3.4738, 2: 3.4484}, default=2)
    assert choice.threads == 1 and choice.contended is None
    assert "instead of 2: as fast now (within 10%)" in choice.reason
    assert choose({1: 0.100, 2: 0.105}, default=2).threads == 1
    assert choose({1: 0.30, 2: 0.17, 4: 0.16, 8: 0.165}, default=8).threads == 2


def test_a_busy_core_is_contention_and_one_thread_is_measured():
    # the shared Xeon: 9.9 samples/s at 2 threads, ~400 at 1 (another process on the second core)
    choice = choose({1: 16 / 400, 2: 16 / 9.9}, default=2)
    assert choice.threads == 1
    assert choice.contended is not None and "40.4x as long at 2 threads as at 1" in choice.contended
    # the speedups are 1 thread's: a layout's gain moves with the count (busy_bench.py)
    assert "the speedups at 1 thread, which can differ from those at 2" in choice.contended
    assert "instead of 2" in choice.reason
    assert choice.to_dict()["contended"] == choice.contended


def test_mildly_faster_at_fewer_threads_is_not_called_contention():
    choice = choose({1: 0.08, 2: 0.10}, default=2)
    assert choice.threads == 1 and choice.contended is None


def test_nothing_timed_is_an_error_naming_the_fix():
    with pytest.raises(UsageError, match="pass threads=N"):
        choose({}, default=2)


def test_a_bad_threads_setting_is_refused_in_one_line():
    with pytest.raises(UsageError, match="threads"):
        BenchConfig(threads=0)
    with pytest.raises(UsageError, match="threads"):
        BenchConfig(threads="many")


@pytest.fixture
def two_threads():
    """Two intra-op threads to choose from (an xdist worker runs on one: tests/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_bench_measures_at_the_chosen_threads_and_says_so(monkeypatch, two_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    w = mixprec.load_workload("mlp", hidden=64, depth=1)
    result = mixprec.bench(w, policies="fp32", channels_last="off", steps=2, warmup=1, isolate=False)
    assert result.settings["threads"] in counts(torch.get_num_threads())
    assert any(n.startswith(f"measured at {result.settings['threads']} threads") for n in result.notes)
    assert ThreadChoice(1, 2, {1: 1.0, 2: 1.0}).contended is None
    fixed = mixprec.bench(
        w, policies="fp32", channels_last="off", steps=2, warmup=1, isolate=False, threads=1
    )
    assert fixed.settings["threads"] == 1 and not any(n.startswith("measured at") for n in fixed.notes)


def test_an_in_process_sweep_leaves_the_callers_threads_as_they_were(two_threads):
    before = torch.get_num_threads()
    w = mixprec.load_workload("mlp", hidden=64, depth=1)
    mixprec.bench(w, policies="fp32", channels_last="off", steps=1, warmup=1, isolate=False, threads=1)
    assert torch.get_num_threads() == before


def test_tune_judges_numerics_at_the_threads_it_measures_at(monkeypatch, two_threads):
    """The numerics checks run in tune's own process. They ran at torch's default count while every
    sweep measured at the chosen one: beside two busy processes on the 2-core EPYC a strict-fp32
    step took 2.9 s at the chosen 1 thread and 10.2 s at the default 2, so the check tune priced
    from its sweep's steps would have taken 3.5x as long."""
    from mixprec.frameworks.torch.framework import TorchFramework
    from mixprec.tuning import run as tune_run
    from mixprec.tuning.search import Search

    seen: list[int] = []
    real = TorchFramework.trajectory

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TorchFramework, "trajectory", spy)
    contended = ThreadChoice(1, 2, {1: 2.9, 2: 10.2})
    monkeypatch.setattr(tune_run, "pick_threads", lambda *args, **kwargs: contended)
    # no race: its in-process sessions set the chosen count themselves, and would hide the checks'
    monkeypatch.setattr(Search, "race_finalists", lambda self: None)
    w = mixprec.load_workload("mlp", hidden=64, depth=1)
    # fp8-rowwise is predicted on a CPU whichever policy is faster here: a check runs either way,
    # and the budget is one tune on a busy CI worker cannot spend (it once left no time for one)
    mixprec.tune(
        w, budget_s=600, steps=2, warmup=1, check_steps=2, device="cpu", lint=False,
        compile_modes=(), optimizers=False, policies=("fp32", "bf16-mixed", "fp8-rowwise"),
    )  # fmt: skip
    assert seen and set(seen) == {1}, seen
    assert torch.get_num_threads() == 2  # the caller's count, back
