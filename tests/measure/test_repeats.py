"""One truth for one configuration (issue 36): a speedup's interval is where a repeat run of it on
this machine lands, the spread between runs learned from the speedups measured more than once."""

from __future__ import annotations

import json
import math
import random
import statistics
from itertools import permutations

import pytest
import torch

import mixprec
from mixprec.errors import CacheWarning
from mixprec.measure.repeats import BETWEEN_RUN_SD, PRIOR_DF, Repeats, pooled_between_run_sd, widen
from mixprec.measure.results import median_ci

# ResNet-50 (128 px, batch 16) bf16-mixed+cl+compile-step: the paired ratios of three
# `mixprec.bench` runs back to back on the quiet 2-core AMD EPYC (2026-11-28; 4 digits kept)
EPYC_RUNS = (
    (1.8001, 1.9529, 2.0223, 1.9739, 2.0863, 2.1392, 1.7121, 2.0754, 1.9132, 1.8837),
    (1.9466, 1.8459, 1.8734, 1.8248, 1.7251, 1.8364, 1.7548, 1.8327, 1.7459, 1.7466),
    (1.8571, 1.8688, 1.769, 1.937, 2.0453, 1.832, 1.7959, 1.8505, 1.8782, 1.8511),
)


def intervals(runs, sd):
    return [(statistics.median(r), widen(statistics.median(r), median_ci(r), sd)) for r in runs]


def test_each_epyc_repeat_lands_inside_the_others_intervals_once_the_spread_between_runs_is_in():
    # the run's own bootstrap interval alone: the first run's 1.963x is outside the second's
    # [1.75-1.85] (the defect: an interval that excludes a repeat measurement)
    alone = intervals(EPYC_RUNS, 0.0)
    assert any(not lo <= a <= hi for (a, _), (_, (lo, hi)) in permutations(alone, 2))
    # learned from these very runs (one configuration, two degrees of freedom, with the prior)
    repeats = Repeats.__new__(Repeats)
    repeats.devices = {
        "AMD EPYC": {"r50": [[math.log(m), (math.log(hi / lo)) / 3.92] for m, (lo, hi) in alone]}
    }
    sd, basis = repeats.between_run_sd("AMD EPYC")
    assert 0.025 < sd < 0.04 and "2 repeats measured on this machine" in basis
    for (a, _), (_, (lo, hi)) in permutations(intervals(EPYC_RUNS, sd), 2):
        assert lo <= a <= hi


def test_the_pooled_spread_recovers_a_planted_one_and_takes_out_each_runs_own_noise():
    rng = random.Random(0)
    for planted in (0.0, 0.05):
        configs = []
        for _ in range(40):
            true = rng.gauss(0.5, 0.3)
            run_effects = [rng.gauss(0, planted) for _ in range(3)]
            configs.append([(true + b + rng.gauss(0, 0.02), 0.02) for b in run_effects])
        sd, df = pooled_between_run_sd(configs)
        assert df == 80
        assert sd == pytest.approx(planted, abs=0.012)  # the 2% noise of each run is not counted


def test_a_configuration_measured_once_teaches_nothing():
    assert pooled_between_run_sd([[(0.5, 0.01)], [(0.7, 0.02)]]) == (0.0, 0)


def test_without_repeats_the_prior_holds_and_the_interval_says_so(tmp_path):
    sd, basis = Repeats(tmp_path / "repeats.json").between_run_sd("any cpu")
    assert sd == pytest.approx(BETWEEN_RUN_SD)
    assert basis.startswith("the prior: no speedup was measured twice")


def test_the_machines_own_repeats_outweigh_the_prior_as_they_accumulate(tmp_path):
    path = tmp_path / "repeats.json"
    for _ in range(9):  # nine identical runs: no spread between them at all
        repeats = Repeats(path)
        repeats.record("cpu", "config", 2.0, (1.98, 2.02))
        repeats.save()
        assert Repeats(path).devices["cpu"]["config"][-1][0] == pytest.approx(math.log(2.0))
    kept = Repeats(path)
    assert len(kept.devices["cpu"]["config"]) == 8  # the latest runs only
    sd, basis = kept.between_run_sd("cpu")
    assert sd == pytest.approx(BETWEEN_RUN_SD * math.sqrt(PRIOR_DF / (PRIOR_DF + 7)))
    assert "7 repeats" in basis
    assert kept.between_run_sd("another cpu")[0] == pytest.approx(BETWEEN_RUN_SD)  # per device


def test_a_broken_repeats_file_is_a_warning_and_reads_as_none(tmp_path):
    path = tmp_path / "repeats.json"
    path.write_text("{not json")
    with pytest.warns(CacheWarning, match="unreadable"):
        repeats = Repeats(path)
    assert repeats.between_run_sd("cpu")[0] == pytest.approx(BETWEEN_RUN_SD)
    path.write_text(json.dumps({"version": 1, "devices": {"cpu": {"k": [[0.5, -1.0], "x", [0.6, 0.01]]}}}))
    assert Repeats(path).devices == {"cpu": {"k": [[0.6, 0.01]]}}  # the bad runs left out


def test_a_widened_interval_keeps_its_sides_and_a_zero_spread_keeps_it_as_it_was():
    assert widen(2.0, (1.9, 2.2), 0.0) == (1.9, 2.2)
    low, high = widen(2.0, (1.9, 2.2), 0.03)
    assert low < 1.9 and high > 2.2
    assert math.log(high / 2.0) > math.log(2.0 / low)  # the wider side stays the wider


def test_bench_learns_the_spread_from_its_own_repeats_and_says_what_its_intervals_hold(own_cache_dir):
    tmp_path = own_cache_dir
    workload = mixprec.load_workload("mlp")
    # bf16-mixed measured whatever its speed (a prune factor nothing reaches): a pruned row is no
    # repeat, and where bf16 is only emulated (an AVX2-only CPU) it is far slower than fp32
    settings = {"policies": "fp32,bf16-mixed", "steps": 3, "device": "cpu", "threads": 1, "prune_factor": 1e6}
    first = mixprec.bench(workload, **settings)
    assert "prior" in first.between_run_basis
    second = mixprec.bench(workload, **settings)
    stored = json.loads((tmp_path / "repeats.json").read_text())["devices"]
    ((device, configs),) = stored.items()
    (runs,) = configs.values()  # one configuration (bf16-mixed over strict fp32), two runs
    assert len(runs) == 2
    assert "1 repeat measured on this machine" in Repeats().between_run_sd(device)[1]  # the next run's
    row = next(r for r in second.rows if r.label == "bf16-mixed")
    paired = median_ci(row.paired_ratios)
    unpaired = row.throughput / next(r for r in second.rows if r.label == "fp32").throughput
    # the run's own noise, what candidates measured together are ranked by: the paired rounds'
    # interval, stretched to the row's own samples/s where they fall outside it (one truth: under
    # load they can, and the interval then covers both)
    within = (min(paired[0], unpaired), max(paired[1], unpaired))
    assert row.speedup_ci == within
    assert row.repeat_ci == widen(row.speedup_vs_fp32, within, second.between_run_sd) == row.interval
    assert row.repeat_ci[0] < within[0] and row.repeat_ci[1] > within[1]
    assert mixprec.BenchResult.from_dict(second.to_dict()).rows[1].repeat_ci == pytest.approx(row.repeat_ci)
    from mixprec.report.bench import summary_line

    assert "where a repeat run lands, 19 times in 20" in summary_line(second)


def test_two_models_of_the_users_own_under_one_name_are_not_repeats_of_each_other(own_cache_dir):
    """Two user models named alike (the same label and description: a model edited between runs)
    were recorded as two runs of one configuration: their different speedups read as this machine's
    spread between runs, and widened every later interval. A model or script of the user's own is
    not recorded, as the record does not pool it (`record.poolable`); the zoo's still is."""
    settings = {"policies": "fp32,bf16-mixed", "steps": 3, "device": "cpu", "threads": 1, "prune_factor": 1e6}

    def mine(width: int) -> mixprec.Workload:
        return mixprec.Workload(
            model=torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)),
            make_batch=lambda n, device: (
                torch.randn(n, 32, device=device),
                torch.randn(n, 4, device=device),
            ),
            loss_fn=lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
            name="mine",
        )

    for width in (16, 512):
        mixprec.bench(mine(width), **settings)
    assert Repeats().devices == {}
    mixprec.bench(mixprec.load_workload("mlp"), **settings)
    ((_, configs),) = Repeats().devices.items()
    assert [len(runs) for runs in configs.values()] == [1]


def test_a_resumed_sweep_records_no_repeat_of_the_rows_it_read_back(own_cache_dir):
    """`bench --resume` of a finished sweep measured nothing, yet recorded every row it read back
    from the stream as one more run of its configuration: a repeat that agrees exactly, which
    pulled this machine's spread between runs towards 0 and narrowed every later interval. The
    interrupted run records what it measured, once."""
    tmp_path = own_cache_dir
    workload = mixprec.load_workload("mlp")
    settings = {"policies": "fp32,bf16-mixed", "steps": 3, "device": "cpu", "threads": 1, "prune_factor": 1e6}
    jsonl = tmp_path / "sweep.jsonl"

    def interrupt(event):  # Ctrl-C once bf16-mixed's row is in: the run --resume exists for
        if event["event"] == "row" and event["row"].label == "bf16-mixed":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mixprec.bench(workload, jsonl=jsonl, events=interrupt, **settings)
    ((device, configs),) = Repeats().devices.items()
    assert [len(runs) for runs in configs.values()] == [1]  # bf16-mixed over strict fp32, measured once
    for _ in range(2):
        again = mixprec.bench(workload, jsonl=jsonl, resume=True, **settings)
        assert any("resumed a complete sweep" in n for n in again.notes)
    assert Repeats().devices == {device: configs}
    assert "prior" in Repeats().between_run_sd(device)[1]
