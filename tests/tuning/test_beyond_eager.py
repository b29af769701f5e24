"""torch.compile and the optimizer's implementation as candidate axes: measured, counted, checked."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec
from mixprec.checking.check import check
from mixprec.cli import main
from mixprec.errors import UnsupportedError
from mixprec.frameworks.torch.session import with_implementation
from mixprec.measure.sweep import bench
from mixprec.policy import Candidate
from mixprec.workload import Workload, load_workload


class BreaksTheGraph(nn.Module):
    """An MLP whose forward reads a tensor value into Python: dynamo must break the graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if h.mean().item() > 1e9:  # data-dependent Python control flow: a graph break
            h = h * 0
        return self.b(h)


def _workload(model: nn.Module) -> Workload:
    return Workload(
        model=model,
        make_batch=lambda bs, dev: (torch.randn(bs, 16, device=dev), torch.randint(0, 4, (bs,), device=dev)),
        loss_fn=lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1]),
        name="breaks",
        default_batch_size=8,
    )


@pytest.mark.slow
def test_compiled_candidates_report_compile_time_and_graph_breaks(single_thread):
    clean = bench(
        load_workload("mlp"),
        candidates=[Candidate("fp32"), Candidate("fp32", compile="default")],
        steps=2,
        warmup=1,
        device="cpu",
        isolate=False,
    )
    compiled = next(r for r in clean.rows if r.candidate.compile)
    assert compiled.status == "ok", compiled.reason
    assert compiled.graph_breaks == 0 and compiled.graphs and compiled.graphs >= 1
    assert compiled.compile_s is not None and compiled.compile_s > 0
    assert compiled.label == "fp32+compile"

    broken = bench(
        _workload(BreaksTheGraph()),
        candidates=[Candidate("fp32"), Candidate("fp32", compile="default")],
        steps=2,
        warmup=1,
        device="cpu",
        isolate=False,
    )
    row = next(r for r in broken.rows if r.candidate.compile)
    assert row.status == "ok", row.reason
    assert row.graph_breaks and row.graph_breaks >= 1


def test_every_measured_row_says_how_much_of_its_step_is_matmul(single_thread):
    # (prune_factor: measured whatever its speed; bf16 is emulated and ~10x slower on an AVX2-only CPU)
    w = load_workload("mlp")
    result = bench(
        w, policies="fp32,bf16-mixed", steps=2, warmup=1, device="cpu", isolate=False, prune_factor=1e6
    )
    for row in result.rows:
        assert row.compute_share is not None and 0.0 < row.compute_share <= 1.0


@pytest.mark.slow
def test_check_judges_a_compiled_candidate_against_eager_fp32(single_thread):
    from torch._dynamo.utils import counters

    counters.clear()
    w = load_workload("mlp")
    res = check(w, policies=[Candidate("bf16-mixed", compile="default")], steps=4, device="cpu")
    verdict = res.candidates[0]
    assert verdict.candidate.compile == "default"
    assert verdict.verdict == "pass", verdict.reason
    assert verdict.max_rel_loss_diff is not None and verdict.max_rel_loss_diff > 0  # it did run bf16
    assert counters["stats"]["unique_graphs"] >= 1  # and it did run compiled


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
def test_an_optimizer_switched_to_another_implementation_steps_identically(opt, impl):
    """Same hyper-parameters, same result (to rounding): only the kernels differ."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    make = {
        "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
        "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    }[opt]
    twin = copy.deepcopy(model)
    reference, switched = make(model.parameters()), with_implementation(make(twin.parameters()), impl)
    assert switched.defaults["lr"] == reference.defaults["lr"]
    for g in switched.param_groups:
        assert g.get("fused", False) == (impl == "fused") and g.get("foreach", False) == (impl == "foreach")
    for _ in range(3):
        x = torch.randn(4, 8)
        for m, o in ((model, reference), (twin, switched)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    torch.testing.assert_close(twin.weight, model.weight, rtol=1e-5, atol=1e-6)


def test_an_optimizer_without_the_implementation_is_unsupported_with_the_reason():
    opt = torch.optim.LBFGS(nn.Linear(2, 2).parameters())
    with pytest.raises(UnsupportedError, match="LBFGS has no fused implementation"):
        with_implementation(opt, "fused")


def test_tune_rejects_an_unknown_compile_mode_in_one_line(capsys):
    assert main(["tune", "--model", "mlp", "--compile", "fastest"]) == 2
    err = capsys.readouterr().err
    assert "Unknown PyTorch compile mode 'fastest'" in err and "max-autotune-no-cudagraphs" in err
    assert len(err.strip().splitlines()) == 1


def test_tune_api_rejects_a_bad_run_length():
    with pytest.raises(mixprec.UsageError, match="train_steps must be an integer >= 1, got 0"):
        mixprec.tune(load_workload("mlp"), train_steps=0)


def test_the_profiled_steps_op_times_are_key_averages_read_without_its_cost():
    """The profiled warm-up step's compute and optimizer shares, read from the profiler's raw events,
    are what ``key_averages()`` says (it took 7.5 s per candidate on a convnext_atto step: every
    event a Python object, then their tree). A conv net with a for-loop AdamW: nested ops, backward
    and the optimizer's own record_function."""
    import torchvision
    from torch.profiler import ProfilerActivity, profile

    from mixprec.frameworks.torch.session import compute_share, cpu_op_times, optimizer_share

    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(2, 3, 32, 32)

    def step() -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    fast, slow = cpu_op_times(prof), prof.key_averages()
    assert {e.key for e in fast} == {e.key for e in slow}
    own = {e.key: e.self_cpu_time_total for e in slow}
    assert all(e.self_cpu_time_total == pytest.approx(own[e.key], abs=1e-3) for e in fast)
    assert compute_share(fast, False) == pytest.approx(compute_share(slow, False))
    assert optimizer_share(fast) == pytest.approx(optimizer_share(slow))
    assert optimizer_share(fast) is not None and 0 < optimizer_share(fast) < 1
