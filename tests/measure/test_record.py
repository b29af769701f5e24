"""One record per configuration on this machine (mixprec.measure.record): a settled figure pools
the sessions this machine measured of the same configuration before with its own, so the next
command repeats it (issue 53); what keeps the record from answering for something else."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch

from mixprec import Workload, bench, load_workload
from mixprec.errors import CacheWarning
from mixprec.measure import record
from mixprec.measure.record import MAX_AGE_S, POOLED, Record, agreeing, configuration, poolable
from mixprec.measure.results import BenchResult, BenchRow, session_speedup
from mixprec.measure.settle import rounds_wanted, sessions_so_far
from mixprec.policy import Candidate

SETTINGS = {"workload": "mlp", "batch_size": 64, "threads": 1, "steps": 4, "warmup": 1, "torch": "2.14.1"}


# ---------------------------------------------------------------------- the configuration
def test_how_long_a_configuration_was_sampled_is_not_part_of_it_and_everything_else_is():
    bf16 = Candidate("bf16-mixed")
    key = configuration(SETTINGS, "an MLP", bf16)
    # tune's sweep (4 rounds, 1 warm-up) and bench's (10, 2) measure one figure
    assert configuration({**SETTINGS, "steps": 10, "warmup": 2, "prune_factor": 5.0}, "an MLP", bf16) == key
    assert configuration({**SETTINGS, "threads": 2}, "an MLP", bf16) != key
    assert configuration({**SETTINGS, "batch_size": 32}, "an MLP", bf16) != key
    assert configuration({**SETTINGS, "torch": "2.15.0"}, "an MLP", bf16) != key
    assert configuration(SETTINGS, "another MLP", bf16) != key
    assert configuration(SETTINGS, "an MLP", Candidate("bf16-mixed", channels_last=True)) != key


def test_only_a_workload_built_from_its_name_and_sizes_is_recorded():
    assert poolable("torch", load_workload("mlp"))
    mine = Workload(
        model=torch.nn.Linear(4, 4),
        make_batch=lambda n, device: (torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)),
        loss_fn=lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
        name="mlp",
    )
    assert not poolable("torch", mine)  # a model of the user's own may change under the same name


# ---------------------------------------------------------------------- the record file
def test_earlier_sessions_are_the_latest_within_a_day_and_never_the_rows_own(tmp_path):
    kept = Record(tmp_path / "record.json")
    now = 1_000_000.0
    kept.add("cpu", "k", [1.5, 1.6], at=now - MAX_AGE_S - 1)  # older than a day: not pooled
    for i in range(POOLED + 2):
        kept.add("cpu", "k", [2.0 + i / 100, 2.1], at=now - 100 + i)
    own = [[2.0 + (POOLED + 1) / 100, 2.1]]  # the row's own session is recorded too
    earlier = kept.earlier("cpu", "k", own, now=now)
    assert len(earlier) == POOLED
    assert tuple(own[0]) not in earlier and (1.5, 1.6) not in earlier
    assert earlier[-1] == (2.0 + POOLED / 100, 2.1)  # the latest, in order
    assert kept.earlier("cpu", "other", own, now=now) == () and kept.earlier("gpu", "k", own, now=now) == ()
    kept.save()
    assert Record(tmp_path / "record.json").earlier("cpu", "k", own, now=now) == earlier


def test_a_record_keeps_only_its_latest_sessions_and_refuses_rounds_that_are_no_speedups(tmp_path):
    kept = Record(tmp_path / "record.json")
    for i in range(record.KEPT + 5):
        kept.add("cpu", "k", [1.0 + i], at=float(i))
    kept.add("cpu", "k", [float("nan"), 2.0])
    kept.add("cpu", "k", [0.0])
    kept.add("cpu", "k", [])
    entries = kept.devices["cpu"]["k"]
    assert len(entries) == record.KEPT and entries[0]["rounds"] == [6.0]


def test_a_broken_record_file_is_a_warning_and_reads_as_empty(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("{not json")
    with pytest.warns(CacheWarning, match="speedup record"):
        assert Record(path).devices == {}
    path.write_text(json.dumps({"version": 1, "devices": {"cpu": {"k": [{"rounds": ["x"], "at": 1}, 5]}}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Record(path).devices == {}  # bad entries dropped one by one


# ---------------------------------------------------------------------- what a figure pools
def test_a_figure_pools_its_earlier_sessions_as_it_pools_its_own():
    earlier = ((1.9, 2.0, 2.1, 2.0), (2.2, 2.1, 2.3, 2.2))
    own = (1.8, 1.9, 2.0, 1.95)
    pooled = session_speedup(own, earlier=earlier)
    assert pooled == session_speedup((*earlier[0], *earlier[1], *own), (4, 4, 4))
    assert session_speedup(own, earlier=()) == session_speedup(own)


def test_a_row_with_earlier_sessions_reports_their_pooled_figure_and_round_trips():
    base = BenchRow("mlp", Candidate("fp32"), "cpu", 8, "ok", step_times_ms=(10.0,) * 4)
    earlier = ((2.0, 2.1, 1.9, 2.0), (2.05, 2.0, 2.1, 1.95))
    row = BenchRow("mlp", Candidate("bf16-mixed"), "cpu", 8, "ok", paired_ratios=(1.7, 1.8, 1.75, 1.8))
    pooled = BenchRow(**{**row.__dict__, "earlier": earlier})
    result = BenchResult("mlp", "", "cpu", 8, {}, measured=[base, pooled])
    (_, figure) = result.rows
    assert figure.speedup_vs_fp32 == session_speedup(row.paired_ratios, earlier=earlier)[0]
    assert (
        figure.speedup_vs_fp32
        != BenchResult("mlp", "", "cpu", 8, {}, measured=[base, row]).rows[1].speedup_vs_fp32
    )
    assert BenchRow.from_dict(json.loads(json.dumps(figure.to_dict()))) == figure


def test_earlier_sessions_count_towards_settling():
    """A figure the record already settles needs no more sessions (tune keeps nothing back for it)."""
    own = BenchRow(
        "mlp",
        Candidate("bf16-mixed"),
        "cpu",
        8,
        "ok",
        paired_ratios=(2.0, 2.02, 1.98, 2.0),
        speedup_vs_fp32=2.0,
        speedup_ci=(1.95, 2.05),
    )
    assert rounds_wanted(own, width=0.05, most=40) == 4 and sessions_so_far(own) == 1
    recorded = BenchRow(**{**own.__dict__, "earlier": ((2.0, 2.01, 1.99, 2.0),) * 2})
    assert rounds_wanted(recorded, width=0.05, most=40) == 0 and sessions_so_far(recorded) == 3


def test_a_record_the_rows_own_figure_lies_far_outside_is_not_pooled_and_an_odd_process_is():
    """Something changed under the same configuration (an environment variable, an allocator): the
    command's own figure. An odd process 10-15% off the record is what pooling is for."""
    earlier = ((2.0, 2.01, 1.99, 2.0), (2.02, 2.0, 2.03, 2.01), (1.98, 2.0, 1.99, 1.97))
    assert agreeing((1.95, 2.0, 2.1, 2.05), (), earlier) == earlier
    assert agreeing((1.72, 1.75, 1.73, 1.74), (), earlier) == earlier  # 13% slow: an odd process
    assert agreeing((1.2, 1.25, 1.22, 1.18), (), earlier) == ()
    assert agreeing((2.9, 3.0, 3.1, 3.0), (), earlier) == ()
    assert record.disagreed(earlier).startswith(
        "not pooled with this machine's 3 earlier sessions of it (2.0"
    )
    # a record whose sessions spread widely reaches further
    wide = ((1.5, 1.5), (2.0, 2.0), (2.6, 2.6))
    assert agreeing((1.2, 1.2), (), wide) == wide


# ---------------------------------------------------------------------- through bench
OPTIONS = dict(policies="fp32,bf16-mixed", channels_last="off", steps=4, warmup=1, isolate=False, threads=1)


def _bf16(result):
    return next(r for r in result.rows if r.label == "bf16-mixed")


def test_the_next_settled_bench_pools_what_the_last_one_measured(own_cache_dir, monkeypatch):
    # (whether its own sessions agree with the record is record.agreeing's, tested above: a tiny
    # MLP's bf16 figure is too noisy to plant agreement through real sweeps)
    monkeypatch.setattr(record, "agreeing", lambda own, sessions, earlier: earlier)
    w = load_workload("mlp")
    first = _bf16(bench(w, device="cpu", settle=0.05, settle_rounds=12, **OPTIONS))
    assert first.earlier == ()  # nothing recorded before it
    again = _bf16(bench(w, device="cpu", settle=0.05, settle_rounds=12, **OPTIONS))
    pooled = [v for s in again.earlier for v in s]
    assert sorted(pooled) == sorted(first.paired_ratios)  # every round the first measured, once
    assert [len(s) for s in again.earlier] == list(first.sessions or [len(first.paired_ratios)])
    own = again.paired_ratios
    assert again.speedup_vs_fp32 == session_speedup(own, again.sessions, earlier=again.earlier)[0]
    assert any("earlier session" in n for n in again.notes)


def test_an_unsettled_bench_is_recorded_but_pools_nothing(own_cache_dir):
    w = load_workload("mlp")
    bench(w, device="cpu", **OPTIONS)
    row = _bf16(bench(w, device="cpu", **OPTIONS))
    assert row.earlier == ()
    assert row.speedup_vs_fp32 == session_speedup(row.paired_ratios)[0]
    entries = Record(own_cache_dir / "record.json").devices
    assert sum(len(v) for configs in entries.values() for v in configs.values()) == 2  # a session each


def test_a_resumed_row_is_not_recorded_twice(own_cache_dir, tmp_path):
    w = load_workload("mlp")
    jsonl = tmp_path / "rows.jsonl"
    bench(w, device="cpu", jsonl=jsonl, **OPTIONS)
    bench(w, device="cpu", jsonl=jsonl, resume=True, **OPTIONS)
    entries = Record(own_cache_dir / "record.json").devices
    assert sum(len(v) for configs in entries.values() for v in configs.values()) == 1


def test_tune_ranks_a_pooled_figure_by_how_well_it_is_known_with_its_earlier_sessions():
    """The noise band two candidates must clear (mixprec.tuning.speedups) is the pooled figure's, not
    its own four rounds': a figure the record settles is not set aside as too noisy to rank."""
    from mixprec.measure.results import assemble
    from mixprec.tuning.speedups import log_speed_se, uncertainty

    base = BenchRow("mlp", Candidate("fp32"), "cpu", 8, "ok", step_times_ms=(10.0,) * 4)
    own = BenchRow("mlp", Candidate("bf16-mixed"), "cpu", 8, "ok", paired_ratios=(1.6, 2.4, 1.9, 2.1))
    earlier = ((2.0, 1.9, 2.1, 2.0, 1.95, 2.05),) * 4
    alone = assemble([base, own], None, {})[1]
    pooled = assemble([base, replace(own, earlier=earlier)], None, {})[1]
    assert log_speed_se(pooled) < log_speed_se(alone) / 2
    assert uncertainty(alone) > 0.1 > uncertainty(pooled)
