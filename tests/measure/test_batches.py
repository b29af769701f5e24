"""Precision x batch (mixprec.measure.batches, `bench --batch-sizes`): peak memory per candidate and
size, the memory model, the largest micro-batch within a budget (measured, never only predicted),
throughput against strict fp32's best, the Pareto front, and an out-of-memory that is a row, not
the end of the sweep. No timing asserts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
import mixprec.frameworks
from mixprec.cli import main
from mixprec.errors import UsageError
from mixprec.measure.batches import bench_batches, parse_batch_sizes

# every row measured whatever its speed (a prune factor nothing reaches): these tests are about memory
# and batch sizes, and where bf16 is only emulated (an AVX2-only CPU) bf16-true is pruned as far slower
FAST = {"steps": 2, "warmup": 1, "isolate": False, "min_time_s": 0.0, "prune_factor": 1e6}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def wide_mlp(oom_from: int | None = None) -> mixprec.Workload:
    """Few weights, wide activations: the peak grows with the batch. ``oom_from``: a batch that
    large raises the CUDA allocator's error, as a device too small for it would."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 4))

    def loss_fn(m, batch):
        if oom_from is not None and batch[0].shape[0] >= oom_from:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return F.cross_entropy(m(batch[0]), batch[1])

    return mixprec.Workload(
        model=model,
        make_batch=lambda b, d: (torch.randn(b, 32, device=d), torch.randint(0, 4, (b,), device=d)),
        loss_fn=loss_fn,
        optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.01),
        name="wide",
    )


def rows_by(sweep):
    return {(r.label, r.batch_size): r for r in sweep.rows}


def test_a_budget_that_binds_gives_each_precision_its_own_largest_batch():
    # strict fp32's memory model alone sets the budget: bf16-true is measured under it below
    free = bench_batches(wide_mlp(), [16, 64, 256], policies="fp32", device="cpu", **FAST)
    fp32 = free.models["fp32"]
    assert fp32.per_sample_bytes >= 1024 * 4  # one fp32 hidden activation a sample at least
    # a budget where strict fp32 fits 64 samples but not 256; bf16-true (half the bytes) fits more
    budget = int(fp32.predict(128))
    sweep = bench_batches(
        wide_mlp(), [16, 64, 256], memory_budget=budget, policies="fp32,bf16-true", device="cpu", **FAST
    )
    rows = rows_by(sweep)
    assert rows["fp32", 256].status == "over-budget" and rows["fp32", 256].samples_per_s is None
    assert rows["fp32", 64].status == "ok" and rows["bf16-true", 256].status == "ok"
    assert sweep.max_batch["bf16-true"] > sweep.max_batch["fp32"] >= 64
    for label, most in sweep.max_batch.items():
        verified = sweep.verified[label]
        assert verified is not None and verified.batch_size == most and verified.peak_bytes <= budget
    # every timed row against strict fp32's best throughput at a size that fits
    fp32_rows = [r for r in sweep.rows if r.label == "fp32" and r.samples_per_s]
    assert max(r.speedup for r in fp32_rows) == pytest.approx(1.0)
    assert any(r.pareto for r in sweep.rows)
    for r in sweep.rows:  # nothing on the front is beaten on both counts
        if r.pareto:
            assert not any(
                o.samples_per_s and o.samples_per_s > r.samples_per_s and o.peak_bytes < r.peak_bytes
                for o in sweep.rows
                if o.peak_bytes
            )
    assert json.loads(json.dumps(sweep.to_dict()))["memory_budget_bytes"] == budget


def test_an_out_of_memory_during_the_sweep_is_a_row_and_the_sweep_goes_on():
    workload = wide_mlp(oom_from=64)
    sweep = bench_batches(workload, [8, 16, 64], policies="fp32,bf16-mixed", device="cpu", **FAST)
    rows = rows_by(sweep)
    for label in ("fp32", "bf16-mixed"):
        assert rows[label, 64].status == "oom" and "out of memory" in rows[label, 64].reason
        assert rows[label, 8].status == rows[label, 16].status == "ok"
        assert sweep.models[label].points[-1].batch_size == 16  # fitted on what was measured


def test_batch_sizes_as_users_write_them():
    assert parse_batch_sizes("32, 8,16,8") == [8, 16, 32]
    for bad in ("8,x", "0", "", "8,-4"):
        with pytest.raises(UsageError, match=r"batch size|no batch sizes"):
            parse_batch_sizes(bad)


def test_bench_batch_sizes_on_the_command_line(tmp_path, capsys):
    factory = tmp_path / "wide.py"
    factory.write_text(
        "import torch, torch.nn.functional as F\nfrom torch import nn\nimport mixprec\n"
        "def workload():\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 4))\n"
        "    return mixprec.Workload(model=model,\n"
        "        make_batch=lambda b, d: (torch.randn(b, 32, device=d),\n"
        "                                 torch.randint(0, 4, (b,), device=d)),\n"
        "        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), name='wide')\n"
    )
    out = tmp_path / "batches.json"
    # on the CPU: a GPU's in-process peak counts what else the process holds (65 MiB on an H200)
    args = ["bench", "--workload", f"{factory}:workload", "--policies", "fp32,bf16-true", "--in-process"]
    args += ["--device", "cpu"]
    sweep_args = ["--batch-sizes", "8,32", "--memory-budget", "64MiB", "--steps", "2", "--json", str(out)]
    assert main([*args, *sweep_args]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "bench-batches" and data["memory_budget_bytes"] == 64 * 2**20
    assert {(r["label"], r["batch_size"]) for r in data["rows"]} == {
        (p, b) for p in ("fp32", "bf16-true") for b in (8, 32)
    }
    assert "precision x batch" in capsys.readouterr().out
    assert main([*args, "--memory-budget", "1GiB"]) == 2
    assert "pass --batch-sizes too" in capsys.readouterr().err
    assert main([*args, "--batch-sizes", "8,x"]) == 2
    assert "'x'" in capsys.readouterr().err


def test_an_accumulated_step_is_the_plain_loops_accumulation():
    """A measured step with accumulation_steps=4 trains exactly as the loop users write: four
    micro-batches, each loss divided by 4, one optimizer step (the weights bitwise)."""
    import copy

    from mixprec.frameworks.session import BenchSettings
    from mixprec.frameworks.torch.session import TrainingSession, make_batches

    w = wide_mlp()
    settings = BenchSettings(
        device="cpu", batch_size=8, steps=1, warmup=1, accumulation_steps=4, profile=False
    )
    micro = make_batches(w, 8, torch.device("cpu"), 0, 4)
    session = TrainingSession(w, mixprec.frameworks.framework_of(w).candidate("fp32"), settings, micro)
    model = copy.deepcopy(w.model)
    optimizer = w.make_optimizer(model)
    loss = session.step(timed=False)["loss"]
    expected = 0.0
    for batch in micro:
        part = w.loss_fn(model, batch) / 4
        part.backward()
        expected += float(part)
    optimizer.step()
    assert loss == pytest.approx(expected, rel=1e-6)
    for got, want in zip(session.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)


def test_throughput_counts_every_micro_batch():
    from mixprec.measure.sweep import bench

    w = wide_mlp()
    plain = bench(w, policies="fp32", batch_size=8, steps=2, warmup=1, isolate=False, device="cpu")
    accumulated = bench(
        w, policies="fp32", batch_size=8, accumulation_steps=4, steps=2, warmup=1, isolate=False, device="cpu"
    )
    row = accumulated.rows[0]
    assert row.accumulation_steps == 4 and accumulated.settings["accumulation_steps"] == 4
    assert row.throughput == pytest.approx(32 / (row.step_time_ms.median_ms / 1e3))
    assert plain.rows[0].accumulation_steps == 1
    with pytest.raises(UsageError, match="accumulation_steps must be an integer >= 1, got 0"):
        bench(w, policies="fp32", accumulation_steps=0, device="cpu")


def test_a_fixed_effective_batch_accumulates_micro_batches():
    sweep = bench_batches(wide_mlp(), [8, 32], effective_batch=32, policies="fp32", device="cpu", **FAST)
    rows = rows_by(sweep)
    assert (rows["fp32", 8].accumulation_steps, rows["fp32", 32].accumulation_steps) == (4, 1)
    assert sweep.results[8].rows[0].accumulation_steps == 4  # bench measured the accumulated step
    with pytest.raises(UsageError, match=r"batch size 12 does not divide the effective batch 32.*8, 16, 32"):
        bench_batches(wide_mlp(), [8, 12], effective_batch=32, device="cpu")


def test_the_largest_batch_is_searched_past_a_fit_that_understates_the_activations():
    """Where the measured sizes sit on the optimizer step's peak (weights, gradients, optimizer state:
    nearly flat in the batch), the line through them promises a batch far too large; the search
    measures there, refits through the largest sizes and returns a size it measured within the budget."""
    from mixprec.frameworks.session import MemoryPoint
    from mixprec.measure.batches import largest_that_fits
    from mixprec.measure.memory import fit

    def peak(batch):  # the optimizer step's 1000 bytes, or the activations' 10 + 5 per sample
        return MemoryPoint(batch, max(1000 + batch // 10, 10 + 5 * batch))

    measured: list[int] = []

    def measure(batch_size):
        measured.append(batch_size)
        return peak(batch_size)

    peaks = {b: peak(b) for b in (16, 32)}
    model = fit("fp32", list(peaks.values()))
    assert model.max_batch(2000) > 5000  # what the flat line promises
    most, verified = largest_that_fits(measure, model, 2000, peaks)
    assert verified is not None and verified.peak_bytes <= 2000 and verified.batch_size == most
    assert most >= 0.9 * (2000 - 10) // 5 and len(measured) <= 6  # near the true 398, in few steps
