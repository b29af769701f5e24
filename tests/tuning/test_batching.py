"""`tune --batch auto`: each candidate's micro-batch under a memory budget (mixprec.tuning.batching),
and the tune that runs them at a fixed effective batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.budget import Budget
from mixprec.errors import PolicyError, UsageError
from mixprec.events import ignore
from mixprec.frameworks.session import BenchSettings, MemoryPoint
from mixprec.tuning.batching import divisors, fit_sizes, plan_micro_batches

sys.path.insert(0, str(Path(__file__).parents[1] / "measure"))
from test_batches import wide_mlp

FP32, BF16, BF16_TRUE = (mixprec.Candidate(p) for p in ("fp32", "bf16-mixed", "bf16-true"))


class LinearMemory:
    """A framework whose step peaks at ``fixed + per_sample * batch`` bytes per policy; a policy in
    ``oom_from`` runs out of memory at that batch and above (as a CUDA device would), one in
    ``broken`` fails with another error at every size."""

    def __init__(self, per_sample: dict[str, int], oom_from: dict[str, int] | None = None, broken=()):
        self.per_sample, self.oom_from, self.broken = per_sample, oom_from or {}, set(broken)
        self.measured: list[tuple[str, int]] = []
        self.accumulated: list[int] = []

    def peak_memory(self, workload, candidate, device, batch_size, accumulation_steps=1):
        self.measured.append((candidate.policy, batch_size))
        self.accumulated.append(accumulation_steps)
        if candidate.policy in self.broken:
            raise ValueError("mat1 and mat2 shapes cannot be multiplied")
        if batch_size >= self.oom_from.get(candidate.policy, 1 << 30):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        held = 100 if accumulation_steps > 1 else 0  # gradients held between micro-batches
        return MemoryPoint(batch_size, 1000 + held + self.per_sample[candidate.policy] * batch_size)


def plan(framework, cands, effective_batch=64, memory_budget=2000):
    return plan_micro_batches(
        framework,
        None,
        cands,
        "cpu",
        effective_batch=effective_batch,
        memory_budget=memory_budget,
        budget_source="--memory-budget",
        events=ignore,
        budget=Budget.unlimited(),
    )


def test_each_candidate_gets_the_largest_dividing_micro_batch_its_memory_allows():
    # fp32 fits (2000 - 1100) / 40 = 22 samples, bf16-mixed 45, bf16-true 100 (capped at 64)
    fw = LinearMemory({"fp32": 40, "bf16-mixed": 20, "bf16-true": 10})
    got = plan(fw, [FP32, BF16, BF16_TRUE])
    chosen = {c.policy: (m.micro_batch, m.accumulation_steps) for c, m in got.choices.items()}
    assert chosen == {"fp32": (16, 4), "bf16-mixed": (32, 2), "bf16-true": (64, 1)}
    # below the effective batch the step was measured accumulating: its held gradients count
    assert all((acc == 2) == (size < 64) for (_, size), acc in zip(fw.measured, fw.accumulated, strict=True))
    for choice in got.choices.values():
        assert choice.peak_bytes is not None and choice.peak_bytes <= 2000  # measured there, inside
        assert (choice.candidate.policy, choice.micro_batch) in fw.measured
    assert got.batched(mixprec.Candidate("bf16-mixed", optimizer="fused")) == mixprec.Candidate(
        "bf16-mixed", optimizer="fused", micro_batch=32, accumulation_steps=2
    )
    # the grid an exhaustive search times: every divisor of 64 up to each one's largest
    assert got.grid == len([d for d in divisors(64) if d <= 16]) + 6 + 7
    assert got.smaller(got.batched(BF16)) == mixprec.Candidate(
        "bf16-mixed", micro_batch=16, accumulation_steps=4
    )


def test_an_out_of_memory_during_the_search_is_recorded_and_the_search_goes_on():
    """The memory model promises more than the device holds (a simulated CUDA OOM from batch 40 up):
    the OOM is recorded on the candidate, counts as past the budget, and a smaller measured size wins;
    the next candidate is searched as usual."""
    fw = LinearMemory({"fp32": 5, "bf16-mixed": 5}, oom_from={"fp32": 40})
    got = plan(fw, [FP32, BF16], effective_batch=64, memory_budget=100_000)
    fp32, bf16 = got.choices[FP32], got.choices[BF16]
    assert fp32.micro_batch == 32 and fp32.status == "ok"
    assert fp32.failures and all(size >= 40 and "oom" in why for size, why in fp32.failures.items())
    assert bf16.micro_batch == 64 and not bf16.failures
    assert json.dumps(got.to_dict())  # the failures are in the JSON


def test_a_failing_candidate_is_recorded_and_the_others_are_planned():
    fw = LinearMemory({"fp32": 10, "bf16-mixed": 10}, broken={"bf16-mixed"})
    got = plan(fw, [BF16, FP32])
    assert got.choices[BF16].micro_batch is None and got.choices[BF16].status == "error"
    assert "mat1 and mat2" in got.choices[BF16].reason
    assert [s for p, s in fw.measured if p == "bf16-mixed"] == [fit_sizes(64)[0]]  # no size cures an error
    assert got.choices[FP32].micro_batch == 64


def test_a_budget_below_the_fitted_sizes_searches_the_divisors_under_them():
    fw = LinearMemory({"fp32": 100})
    got = plan(fw, [FP32], effective_batch=64, memory_budget=1100 + 100 * 5)  # 5 samples fit
    assert got.choices[FP32].micro_batch == 4 and got.choices[FP32].accumulation_steps == 16
    nothing = plan(LinearMemory({"fp32": 100}), [FP32], effective_batch=64, memory_budget=900)
    assert nothing.choices[FP32].micro_batch is None and nothing.choices[FP32].status == "over-budget"


def test_a_candidate_names_its_micro_batch_and_runs_the_runs_samples_per_step():
    cand = mixprec.Candidate("bf16-mixed", micro_batch=16, accumulation_steps=4)
    assert cand.label == "bf16-mixed@16x4" and cand.numerics == mixprec.Candidate("bf16-mixed")
    assert mixprec.Candidate.from_dict(cand.to_dict()) == cand
    with pytest.raises(PolicyError, match="without a micro_batch"):
        mixprec.Candidate("fp32", accumulation_steps=2)
    with pytest.raises(PolicyError, match="micro_batch must be an integer >= 1, got 0"):
        mixprec.Candidate("fp32", micro_batch=0)
    settings = BenchSettings(device="cpu", batch_size=64)
    assert settings.for_candidate(cand) == BenchSettings(device="cpu", batch_size=16, accumulation_steps=4)
    with pytest.raises(UsageError, match=r"fp32@8 trains 8 samples per optimizer step, the run 32"):
        mixprec.bench(wide_mlp(), candidates=[mixprec.Candidate("fp32", micro_batch=8)], batch_size=32)


def test_bench_pairs_candidates_at_their_own_micro_batch_with_a_baseline_at_its_own():
    base = mixprec.Candidate("fp32", micro_batch=8, accumulation_steps=4)
    cand = mixprec.Candidate("bf16-mixed", micro_batch=32)
    result = mixprec.bench(
        wide_mlp(),
        candidates=[cand],
        baseline=base,
        batch_size=32,
        steps=2,
        warmup=1,
        device="cpu",
        isolate=False,
    )
    rows = {r.candidate: r for r in result.measured if not r.baseline_repeat}
    assert (rows[base].batch_size, rows[base].accumulation_steps) == (8, 4)
    assert (rows[cand].batch_size, rows[cand].accumulation_steps) == (32, 1)
    assert result.baseline.candidate == base and result.baseline.accumulation_steps == 4
    assert next(r for r in result.rows if r.candidate == cand).speedup_vs_fp32 is not None
    with pytest.raises(UsageError, match="baseline must be strict fp32"):
        mixprec.bench(wide_mlp(), candidates=[cand], baseline=cand, batch_size=32)


def test_tune_batch_auto_picks_micro_batches_inside_the_budget_and_carries_them_to_the_pick(tmp_path):
    """A budget that binds: strict fp32 fits a micro-batch of 128, the bf16 policies 256 (the wide
    MLP's activations halve). Every candidate timed runs 256 samples per optimizer step, each at a
    micro-batch whose measured peak is inside the budget; the pick carries its micro-batch,
    accumulation and peak into the JSON and the exports."""
    budget = 2_000_000
    result = mixprec.tune(
        wide_mlp(),
        batch="auto",
        memory_budget=budget,
        effective_batch=256,
        # the work bounded by what is searched, not by a clock (40 s asked every plan to fit it)
        policies=("bf16-mixed", "bf16-true"),
        budget_s=3600,
        device="cpu",
        steps=2,
        check_steps=3,
        compile_modes=(),
        optimizers=False,
        lint=False,
    )
    data = result.to_dict()
    plan_ = data["batches"]
    by_label = {c["label"]: c for c in plan_["candidates"]}
    assert by_label["fp32"]["micro_batch"] == 128 and by_label["bf16-mixed"]["micro_batch"] == 256
    for choice in plan_["candidates"]:
        if choice["micro_batch"] is not None:
            assert choice["peak_memory_bytes"] <= budget
    timed = [r for r in result.bench.measured if r.status == "ok"]
    assert timed and all(r.batch_size * r.accumulation_steps == 256 for r in timed)
    assert plan_["timed_points"] < plan_["grid_points"]
    rec = data["recommendation"]
    assert rec["micro_batch"] * rec["accumulation_steps"] == 256
    assert rec["peak_memory_bytes"] is not None and rec["peak_memory_bytes"] <= budget
    assert any("--batch auto: timed" in n for n in data["notes"])
    assert "batch" in data["phases"]


def test_tune_batch_auto_refuses_what_it_cannot_do():
    with pytest.raises(UsageError, match="needs --memory-budget SIZE"):
        mixprec.tune(wide_mlp(), batch="auto", device="cpu")
    with pytest.raises(UsageError, match="apply to batch='auto'"):
        mixprec.tune(wide_mlp(), memory_budget=10**9, device="cpu")
    with pytest.raises(UsageError, match="batch must be 'auto'"):
        mixprec.tune(wide_mlp(), batch="max", device="cpu")


def test_a_candidate_that_accumulates_is_never_compiled_at_step_scope():
    """Dynamo skips a step that loops over backward() (graph break in a loop) and every export
    refuses it: tune must not measure or recommend it."""
    from mixprec.frameworks import framework_of
    from mixprec.measure.results import BenchRow
    from mixprec.tuning.compiling import Calibration, plan

    framework = framework_of(wide_mlp())

    def row(cand: mixprec.Candidate, step_ms: float, speedup: float) -> BenchRow:
        return BenchRow(
            "w", cand, "cpu", cand.micro_batch, "ok", step_times_ms=(step_ms,), speedup_vs_fp32=speedup
        )

    rows = [
        row(mixprec.Candidate("fp32", micro_batch=16, accumulation_steps=2), 10.0, 1.0),
        row(mixprec.Candidate("bf16-mixed", micro_batch=16, accumulation_steps=2), 5.0, 2.0),
        row(mixprec.Candidate("fp16-mixed", micro_batch=32), 5.0, 2.0),
    ]
    attempts = plan(framework, rows, set(), ["default"], Calibration())
    scopes = {(a.candidate.policy, a.candidate.compile_scope) for a in attempts}
    assert ("bf16-mixed", "step") not in scopes and ("bf16-mixed", None) in scopes
    assert ("fp16-mixed", "step") in scopes  # one micro-batch per step: the step scope stands


def test_a_bench_row_with_accumulation_round_trips_through_json():
    """A row accumulated by bench --effective-batch (its candidate names no micro-batch) and a row of
    a candidate with its own micro-batch both read back as they were written (the first raised
    'accumulation_steps=4 without a micro_batch', so such rows were lost on --resume)."""
    from mixprec.measure.results import BenchRow

    plain = BenchRow(
        "w", mixprec.Candidate("bf16-mixed"), "cpu", 8, "ok", step_times_ms=(1.0, 2.0), accumulation_steps=4
    )
    own = mixprec.Candidate("bf16-mixed", micro_batch=8, accumulation_steps=4)
    batched = BenchRow("w", own, "cpu", 8, "ok", step_times_ms=(1.0, 2.0), accumulation_steps=4)
    for row in (plain, batched):
        back = BenchRow.from_dict(json.loads(json.dumps(row.to_dict())))
        assert back.candidate == row.candidate and back.accumulation_steps == 4


def test_the_cuda_budget_is_half_the_free_memory_less_the_margin(monkeypatch):
    """On CUDA without --memory-budget: the paired baseline is resident beside each candidate."""
    from mixprec.frameworks import framework_of
    from mixprec.tuning.batching import memory_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))
    size, source = memory_budget(framework_of(wide_mlp()), "cuda:0", None)
    assert size == int(10 * 2**30 * 0.9 / 2) and "half the free CUDA memory" in source
    assert memory_budget(framework_of(wide_mlp()), "cpu", "2GiB") == (2 * 2**30, "--memory-budget")


def test_the_pick_one_size_down_is_never_a_step_compiled_over_accumulation():
    got = plan(LinearMemory({"bf16-mixed": 10}), [BF16])
    pick = mixprec.Candidate("bf16-mixed", compile="default", compile_scope="step", micro_batch=64)
    assert got.smaller(pick) is None
    assert got.smaller(mixprec.Candidate("bf16-mixed", micro_batch=64)).micro_batch == 32


def test_an_accumulating_step_counts_the_gradients_held_between_micro_batches():
    """On a CPU MemTracker follows one forward per step (two raised NotImplementedError): the held
    gradients are added to one micro-batch's peak."""
    from mixprec.frameworks import framework_of

    w = wide_mlp()
    framework = framework_of(w)
    one = framework.peak_memory(w, FP32, "cpu", 32)
    two = framework.peak_memory(w, FP32, "cpu", 32, 2)
    grads = sum(p.numel() * 4 for p in w.model.parameters())
    assert two.peak_bytes == one.peak_bytes + grads and "held between micro-batches" in two.method


def test_policies_that_store_and_compute_the_same_widths_share_one_memory_search():
    fw = LinearMemory({"fp32": 40, "bf32": 40, "bf16-mixed": 20, "fp16-mixed": 20})
    cands = [mixprec.Candidate(p) for p in ("fp32", "bf32", "bf16-mixed", "fp16-mixed")]
    got = plan(fw, cands)
    assert {p for p, _ in fw.measured} == {"fp32", "bf16-mixed"}  # bf32 and fp16-mixed: not searched again
    micro = {c.policy: m.micro_batch for c, m in got.choices.items()}
    assert micro == {"fp32": 16, "bf32": 16, "bf16-mixed": 32, "fp16-mixed": 32}
    assert got.choices[cands[1]].candidate == cands[1] and "memory of fp32" in got.choices[cands[1]].reason


def test_the_notes_say_what_was_timed_and_that_batch_norm_follows_the_micro_batch():
    from mixprec.tuning.batching import BatchPlan, MicroBatch, notes

    got = BatchPlan(16, 2**30, "--memory-budget")
    got.choices[FP32] = MicroBatch(FP32, 4, 4)
    got.timed = {mixprec.Candidate("fp32", micro_batch=4, accumulation_steps=4)}
    said = notes(got, 8, batch_norm=True)
    assert said[0].startswith("--batch auto: timed 1 (candidate x micro-batch) points of a grid of 3")
    assert "learning rate tuned at 8" in said[1] and "BatchNorm" in said[2] and "down to 4" in said[2]
    assert len(notes(got, 16, batch_norm=False)) == 1
