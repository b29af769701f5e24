"""Sweep logic on tiny workloads: rows, failures, pruning, resume, honesty, files. No timing asserts."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import mixprec
from mixprec.budget import Budget
from mixprec.cli import main
from mixprec.measure.config import parse_choice, parse_policies
from mixprec.measure.results import BenchResult, BenchRow, read_csv, write_csv
from mixprec.measure.rowstore import read_jsonl
from mixprec.measure.sweep import bench
from mixprec.policy import Candidate
from mixprec.schema import SCHEMA_VERSION
from mixprec.workload.loader import load_workload

CPU_POLICIES = [n for n in mixprec.POLICY_NAMES if mixprec.check_support(n, mixprec.detect("cpu"))]

# A factory file whose behaviour under one policy is planted: it fails, sleeps or disables autocast.
FACTORY = textwrap.dedent(
    """
    import time
    import torch
    from torch import nn
    import mixprec

    def _autocast_dtype():
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None

    def _workload(loss_fn, model=None):
        torch.manual_seed(0)
        model = model or nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        def make_batch(batch_size, device):
            x = torch.randn(batch_size, 16, device=device)
            return x, torch.randint(0, 4, (batch_size,), device=device)
        return mixprec.Workload(model=model, make_batch=make_batch, loss_fn=loss_fn, name="planted",
                                default_batch_size=8)

    def ce(model, batch):
        return nn.functional.cross_entropy(model(batch[0]).float(), batch[1])

    def fails_under_fp16():
        def loss_fn(model, batch):
            if _autocast_dtype() == torch.float16:
                raise RuntimeError("planted failure under fp16 autocast")
            return ce(model, batch)
        return _workload(loss_fn)

    def slow_under_fp16():
        def loss_fn(model, batch):
            if _autocast_dtype() == torch.float16:
                time.sleep(4.0)
            return ce(model, batch)
        return _workload(loss_fn)

    class NoAutocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):  # silently defeats the policy
                return self.fc(x.float())

    def defeats_autocast():
        return _workload(ce, model=NoAutocast())

    def nan_loss_under_bf16():
        def loss_fn(model, batch):
            loss = ce(model, batch)
            return loss * float("nan") if _autocast_dtype() == torch.bfloat16 else loss
        return _workload(loss_fn)
    """
)


@pytest.fixture()
def factory_file(tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(FACTORY, encoding="utf-8")
    return path


def _by_label(result):
    return {r.label: r for r in result.rows}


@pytest.mark.slow
def test_every_candidate_gets_a_row_and_unsupported_rows_say_why():
    w = load_workload("mlp")
    result = bench(w, policies="all", channels_last="both", steps=2, warmup=1, isolate=False, device="cpu")
    labels = _by_label(result)
    for name in mixprec.POLICY_NAMES:
        assert name in labels, f"no row for {name}"
    assert labels["tf32"].status == "unsupported"
    assert "compute capability" in labels["tf32"].reason
    assert len(labels["fp32"].step_times_ms) > 2 * 2  # the baseline is timed next to every candidate
    # mlp has no conv weights: channels_last candidates are skipped with one note, not run
    assert not any(r.channels_last for r in result.rows)
    assert any("channels_last" in n for n in result.notes)
    for name in CPU_POLICIES:
        row = labels[name]
        assert row.status in ("ok", "pruned", "no-effect"), (name, row.status, row.reason)
        if row.status == "ok":
            assert row.throughput > 0 and row.step_time_ms.n >= 2
            assert row.first_loss is not None
    baseline = labels["fp32"]
    assert baseline.speedup_vs_fp32 == pytest.approx(1.0)
    assert baseline.flops_per_step and baseline.flops_per_step > 0
    if labels["bf16-mixed"].status == "ok":  # a pruned row (a busy machine) keeps no dtype
        assert labels["bf16-mixed"].observed_dtype == "bfloat16"
    assert labels["fp32"].observed_dtype == "float32"


def test_same_initial_weights_and_batches_give_the_same_first_loss():
    """Every candidate starts from the same weights and sees the same batches: bf32's first loss is
    strict fp32's bit for bit exactly where this CPU's oneDNN ignores the bf32 mode for matmuls (an
    Intel Xeon without AMX here); where it honours it (AMD EPYC with AVX512-BF16), bf32 rounds
    matmul inputs to bf16 and its first loss agrees to bf16's precision only; where it honours it
    for large matmuls only (a Xeon with AMX), the row says bf32 has no effect on this model."""
    from mixprec.hardware.device import detect

    w = load_workload("mlp")
    # at the thread count bf32's effect was detected with: oneDNN picks its kernels by thread count
    threads = torch.get_num_threads()
    result = bench(
        w,
        policies="fp32,bf32",
        channels_last="off",
        steps=1,
        warmup=1,
        isolate=False,
        device="cpu",
        threads=threads,
    )
    rows = {r.label: r for r in result.rows}
    fp32, bf32 = rows["fp32"], rows["bf32"]
    assert fp32.status == "ok" and fp32.first_loss is not None
    if bf32.status == "unsupported":
        return  # no native bf16 on this CPU: nothing ran
    changes = detect("cpu").bf32_changes
    if bf32.status == "no-effect":
        # oneDNN changed the 1024-wide probe matmul but (nearly) none of this model's: on a Sapphire
        # Rapids Xeon with AMX (the GPU machine's host, 2026-11-27) its small matmuls stay fp32. The
        # label must be the model's own effect probe's, on the batch the bench ran
        from mixprec.frameworks.torch.effect import math_mode_effect
        from mixprec.policy import Candidate

        batch = w.make_batch(w.default_batch_size, torch.device("cpu"))
        assert math_mode_effect(w, Candidate("bf32"), batch, torch.device("cpu")).no_effect
        assert bf32.first_loss in (None, fp32.first_loss)
    elif changes and "matmul" in changes:
        assert bf32.status == "ok" and bf32.first_loss != fp32.first_loss
        assert bf32.first_loss == pytest.approx(fp32.first_loss, rel=2**-7)  # bf16 has 8 significand bits
    else:
        assert bf32.status in ("ok", "no-effect")
        assert bf32.first_loss in (None, fp32.first_loss)


def test_failing_candidate_does_not_stop_the_sweep(factory_file):
    w = load_workload(f"{factory_file}:fails_under_fp16")
    result = bench(
        w,
        policies="fp32,fp16-mixed,bf16-mixed",
        channels_last="off",
        steps=2,
        warmup=1,
        isolate=False,
        device="cpu",
    )
    labels = _by_label(result)
    assert labels["fp16-mixed"].status == "error"
    assert "planted failure" in labels["fp16-mixed"].reason
    assert "in loss_fn" in labels["fp16-mixed"].error_traceback
    assert labels["bf16-mixed"].status == "ok"  # measured after the failure


@pytest.mark.slow
def test_failing_candidate_in_child_process(factory_file):
    w = load_workload(f"{factory_file}:fails_under_fp16")
    result = bench(
        w,
        policies="fp32,fp16-mixed",
        channels_last="off",
        steps=2,
        warmup=1,
        device="cpu",
    )
    labels = _by_label(result)
    assert result.settings["isolate"] is True
    assert labels["fp16-mixed"].status == "error" and "planted failure" in labels["fp16-mixed"].reason
    # the child's traceback comes back with the row (the reason keeps one line) and survives JSON
    failed = _by_label(BenchResult.from_dict(result.to_dict()))["fp16-mixed"]
    assert "in loss_fn" in failed.error_traceback and "planted failure" in failed.error_traceback
    # isolated CPU memory is measured, never a silent 0
    assert labels["fp32"].peak_memory_bytes and labels["fp32"].peak_memory_bytes > 0
    assert "isolated" in labels["fp32"].memory_method


@pytest.mark.slow
@pytest.mark.parametrize("isolate", [False, True])
def test_hopeless_candidate_is_pruned_with_its_figure(factory_file, isolate):
    w = load_workload(f"{factory_file}:slow_under_fp16")
    result = bench(
        w,
        policies="fp32,fp16-mixed",
        channels_last="off",
        steps=2,
        warmup=1,
        device="cpu",
        isolate=isolate,
    )
    row = _by_label(result)["fp16-mixed"]
    assert row.status == "pruned", row.reason
    assert "limit" in row.reason or "still running" in row.reason
    if mixprec.check_support("fp16-mixed", mixprec.detect("cpu")).native:
        # pruned on a step over the limit, and again on its retry: never on one transient
        assert row.reason.startswith("pruned twice")
    else:  # fp16 is emulated on this CPU (no AVX512-FP16/AMX-FP16): far slower is expected, no retry
        assert any(n.startswith("not retried: no native fp16") for n in row.notes), row.notes
    if not isolate:  # in-process the step finishes before the verdict, so its figure is kept
        assert row.step_time_ms is not None and row.step_time_ms.median_ms > 1000


def test_autocast_defeated_is_an_error_row_not_a_mislabelled_number(factory_file):
    w = load_workload(f"{factory_file}:defeats_autocast")
    result = bench(
        w,
        policies="fp32,bf16-mixed",
        channels_last="off",
        steps=1,
        warmup=1,
        isolate=False,
        device="cpu",
    )
    row = _by_label(result)["bf16-mixed"]
    assert row.status == "error"
    assert "did not take effect" in row.reason and "'fc'" in row.reason
    assert row.throughput is None


def test_nonfinite_loss_is_an_error_row(factory_file):
    w = load_workload(f"{factory_file}:nan_loss_under_bf16")
    result = bench(
        w,
        policies="fp32,bf16-mixed",
        channels_last="off",
        steps=1,
        warmup=1,
        isolate=False,
        device="cpu",
    )
    rows = _by_label(result)
    assert rows["fp32"].status == "ok"
    assert rows["bf16-mixed"].status == "error" and "non-finite loss" in rows["bf16-mixed"].reason
    # non-finite already in strict fp32 is the workload's bug: one line before any measuring
    w.loss_fn = lambda model, batch: model(batch[0]).sum() * float("nan")
    with pytest.raises(mixprec.UsageError, match="loss_fn returned nan at the first strict-fp32 step"):
        bench(w, policies="fp32", channels_last="off", steps=1, warmup=1, isolate=False, device="cpu")


def test_interrupted_sweep_resumes_without_rerunning_finished_rows(tmp_path):
    jsonl = tmp_path / "sweep.jsonl"
    w = load_workload("mlp")
    finished = []

    def interrupt_after_two(event):
        if event["event"] == "row":
            finished.append(event["row"].label)
            if len(finished) == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench(
            w,
            policies="fp32,bf32,bf16-mixed",
            channels_last="off",
            steps=1,
            warmup=1,
            isolate=False,
            device="cpu",
            jsonl=jsonl,
            events=interrupt_after_two,
        )
    saved = read_jsonl(jsonl)
    assert [r.label for r in saved] == finished  # nothing measured was lost

    started, resumed = [], []

    def record(event):
        if event["event"] == "candidate":
            started.append(event["label"])
        if event["event"] == "row" and event["resumed"]:
            resumed.append(event["row"].label)

    result = bench(
        w,
        policies="fp32,bf32,bf16-mixed",
        channels_last="off",
        steps=1,
        warmup=1,
        isolate=False,
        device="cpu",
        jsonl=jsonl,
        resume=True,
        events=record,
    )
    # finished rows are kept, except strict fp32: every new row is timed against it, so it runs again
    assert finished[0] == "fp32" and resumed == finished[1:]
    assert started == ["fp32", "bf16-mixed"]
    assert [r.label for r in result.rows] == ["fp32", "bf32", "bf16-mixed"]
    # three rows, and strict fp32's closing row again, marked as the repeat
    assert len({r.key for r in read_jsonl(jsonl) if not r.baseline_repeat}) == 3


def test_torn_jsonl_line_is_ignored(tmp_path):
    path = tmp_path / "rows.jsonl"
    row = BenchRow("w", Candidate("fp32"), "cpu", 8, "ok", step_times_ms=(0.9, 1.0, 1.1))
    path.write_text(json.dumps(row.to_dict()) + "\n" + '{"workload": "w", "pol', encoding="utf-8")
    assert [r.to_dict() for r in read_jsonl(path)] == [row.to_dict()]


def test_row_json_and_csv_round_trip(tmp_path):
    row = BenchRow(
        "mlp",
        Candidate("bf16-mixed", channels_last=True, keep_fp32=("head",)),
        "cpu",
        64,
        "ok",
        step_times_ms=(50.0, 51.8, 52.5),
        peak_memory_bytes=123456,
        speedup_vs_fp32=2.5,
        first_loss=2.3,
        flops_per_step=10**9,
        mfu=0.12,
    )
    assert BenchRow.from_dict(json.loads(json.dumps(row.to_dict()))) == row
    data = row.to_dict()  # the output contract's flat keys
    assert (data["policy"], data["channels_last"], data["keep_fp32"]) == ("bf16-mixed", True, ["head"])
    assert data["step_time_ms"] == {"median": 51.8, "iqr": row.step_time_ms.iqr_ms, "n": 3}
    write_csv(tmp_path / "rows.csv", [row])
    (back,) = read_csv(tmp_path / "rows.csv")
    assert back["policy"] == "bf16-mixed" and float(back["throughput"]) == pytest.approx(64 / 0.0518)
    assert float(back["step_time_median_ms"]) == 51.8 and back["step_time_n"] == "3"


def test_parse_policies_and_layouts():
    assert parse_policies("all") == list(mixprec.POLICY_NAMES)
    assert parse_policies("bf16,fp16,bf16-mixed") == ["bf16-mixed", "fp16-mixed"]
    with pytest.raises(mixprec.PolicyError, match="Did you mean 'bf16-mixed'"):
        parse_policies("bf16-mix")
    assert parse_choice("both", "channels_last") == [False, True]
    with pytest.raises(mixprec.UsageError, match="Invalid channels_last 'sometimes'; valid: off, on, both"):
        parse_choice("sometimes", "channels_last")


def test_bad_bench_arguments():
    w = load_workload("mlp")
    with pytest.raises(mixprec.UsageError, match="steps must be an integer >= 1"):
        bench(w, steps=0)
    with pytest.raises(mixprec.UsageError, match=r"mixprec\.Workload"):
        bench(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


@pytest.mark.slow
def test_cli_bench_writes_every_file(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "--model",
            "mlp",
            "--policies",
            "fp32,bf16-mixed",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--min-time",
            "0",
            "--device",
            "cpu",
            "--json",
            str(out / "b.json"),
            "--csv",
            str(out / "b.csv"),
            "--markdown",
            str(out / "b.md"),
            "--plot",
            str(out / "b.png"),
        ]
    )
    assert code == 0
    data = json.loads((out / "b.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["kind"] == "bench"
    assert "precision_state" in data["env"] and "native_bf16" in data["env"]["device"]
    assert {r["policy"] for r in data["rows"]} == {"fp32", "bf16-mixed"}
    assert (out / "b.jsonl").exists() and (out / "b.png").stat().st_size > 10_000
    assert "| bf16-mixed |" in (out / "b.md").read_text()
    assert "bf16-mixed" in capsys.readouterr().out


def test_cli_usage_errors(capsys):
    assert main(["bench", "--model", "mlp", "--resume"]) == 2
    assert "--json" in capsys.readouterr().err
    assert main(["bench", "--model", "resnet5"]) == 2
    assert "Did you mean 'resnet50'" in capsys.readouterr().err
    assert main(["bench", "--model", "mlp", "--policies", "tf32", "--device", "tpu"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_data_parallel_sweep_on_two_gloo_ranks(tmp_path):
    """Two gloo ranks per candidate, their step the slowest rank's, their peak memory each rank's
    own: started from a process holding 768 MiB, a rank read that (``ru_maxrss`` is carried across
    ``exec`` from the process that spawned it) as its tiny MLP's peak."""
    w = load_workload("mlp")
    held = bytearray(768 * 2**20)
    held[::4096] = b"\x01" * len(held[::4096])  # resident, page by page
    result = bench(
        w,
        policies="fp32,bf16-mixed",
        channels_last="off",
        steps=2,
        warmup=1,
        device="cpu",
        nproc=2,
        jsonl=tmp_path / "dp.jsonl",
    )
    labels = _by_label(result)
    for name in ("fp32", "bf16-mixed"):
        row = labels[name]
        assert row.status == "ok", row.reason
        assert row.world_size == 2 and len(row.rank_step_time_ms) == 2
        assert len(row.rank_peak_memory_bytes) == 2 and row.peak_memory_bytes > 0
        assert max(row.rank_peak_memory_bytes) < len(held) // 2  # the MLP's, not this process's
        # global throughput counts both ranks' batches per (slowest-rank) step
        assert row.throughput == pytest.approx(2 * row.batch_size / (row.step_time_ms.median_ms / 1e3))
    assert labels["bf16-mixed"].observed_dtype == "bfloat16"
    assert read_jsonl(tmp_path / "dp.jsonl")[0].world_size == 2
    del held


def test_data_parallel_needs_a_spec():
    w = load_workload("mlp")
    w.spec = None
    with pytest.raises(mixprec.UsageError, match="nproc > 1 needs a workload with a spec"):
        bench(w, nproc=2)


@pytest.mark.slow
@pytest.mark.parametrize("isolate", [False, True])
def test_a_deadline_ends_the_sweep_with_the_rows_measured_so_far(isolate):
    """bench returns (never raises) at a deadline: the baseline is finished, later candidates skipped."""
    w = load_workload("mlp")
    result = bench(
        w,
        policies="fp32,bf16-mixed,fp16-mixed,bf16-true",
        channels_last="off",
        steps=2,
        warmup=1,
        device="cpu",
        isolate=isolate,
        budget=Budget(0.5),
    )
    # Two words for one end, by how the clock fell: the deadline passed before a candidate, or
    # the time left could not pay for the next one (a flake in CI: the in-process sweep measured
    # bf16-mixed in well under the 0.5 s, then had "0 s left" before fp16-mixed).
    assert result.stopped, result.stopped
    assert "deadline" in result.stopped or "could not pay for it" in result.stopped, result.stopped
    labels = _by_label(result)
    assert labels["fp32"].status == "ok" and labels["fp32"].throughput
    assert len(result.rows) < 4


@pytest.mark.usefixtures("own_cache_dir")
def test_a_resume_keeps_the_thread_count_its_rows_were_measured_at(tmp_path):
    """With threads 'auto' a resume chose its count again, and that follows the machine's load of
    the moment (2 threads quiet, 1 beside a busy process): the resume was then refused, "rows
    measured under other settings: threads=2 (now 1)" (the flake of the test below, 4 runs in 25
    beside two busy loops). Planted: rows at 2 threads, then a process whose torch runs 1 thread,
    where 'auto' times nothing and takes torch's count."""
    import torch

    jsonl = tmp_path / "sweep.jsonl"
    w = load_workload("mlp")
    options = dict(policies="fp32,bf16-mixed", channels_last="off", steps=1, warmup=1, isolate=False)
    first = bench(w, device="cpu", jsonl=jsonl, threads=2, **options)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = []
        again = bench(
            w, device="cpu", jsonl=jsonl, resume=True, events=lambda e: started.append(e["event"]), **options
        )
    finally:
        torch.set_num_threads(before)
    assert "candidate" not in started
    assert [r.to_dict() for r in again.rows] == [r.to_dict() for r in first.rows]
    assert again.settings["threads"] == 2
    assert any(n.startswith("threads: 2, the count the resumed rows were measured at") for n in again.notes)


@pytest.mark.usefixtures("own_cache_dir")
def test_mfu_divides_by_the_peak_at_the_thread_count_the_rows_ran_at():
    """MFU's denominators were measured (or read from the cache) at the calling process's torch
    thread count, not the sweep's: rows measured at 2 threads from a 1-thread process divided by the
    1-thread peak and read about twice the MFU (so did a resume of them, beside the original's)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = bench(
            load_workload("mlp"), device="cpu", policies="fp32", steps=1, warmup=1, isolate=False, threads=2
        )
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    (row,) = result.rows
    assert "2 threads" in row.peak_flops_source, row.peak_flops_source


@pytest.mark.usefixtures("own_cache_dir")
def test_resuming_a_complete_sweep_measures_nothing(tmp_path):
    """Issue 26: each resume of a finished sweep re-measured strict fp32 and appended another fp32
    row to the stream (four of them after a torn tail and two resumes)."""
    # a cache of its own: the repeats other tests recorded of this configuration (the session's
    # cache) moved the spread between runs the resumed rows' intervals are widened by (a flake)
    jsonl = tmp_path / "sweep.jsonl"
    w = load_workload("mlp")
    options = dict(policies="fp32,bf16-mixed", channels_last="off", steps=1, warmup=1, isolate=False)
    first = bench(w, device="cpu", jsonl=jsonl, **options)
    lines = jsonl.read_text().splitlines()
    started = []
    for _ in range(2):
        again = bench(
            w, device="cpu", jsonl=jsonl, resume=True, events=lambda e: started.append(e["event"]), **options
        )
        assert "candidate" not in started  # nothing was measured
        assert [r.to_dict() for r in again.rows] == [r.to_dict() for r in first.rows]
        assert any("resumed a complete sweep" in n for n in again.notes)
    assert jsonl.read_text().splitlines() == lines  # the stream grew by nothing
