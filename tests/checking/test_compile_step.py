"""A candidate compiled at step scope (forward, loss, backward and the optimizer step in one
torch.compile'd function) is measured with its graphs counted and passes or fails `check` with
the reason, like any other candidate."""

from __future__ import annotations

import pytest

import mixprec
from mixprec.policy import Candidate

STEP = Candidate("bf16-true", compile="default", compile_scope="step")


@pytest.fixture(scope="module")
def gpt():
    return mixprec.load_workload("gpt2", n_layer=1, n_head=2, n_embd=64, seq_len=16)


@pytest.fixture
def aot_eager():
    """Every graph to aot_eager (torch's own debug switch, through its config's own patch: a
    monkeypatch's undo deleted the option and every later compile in the worker failed): Dynamo
    captures and counts the step's graphs as under Inductor, without Inductor making kernels
    (about 30 of this test's 32-55 s)."""
    import torch._dynamo

    with torch._dynamo.config.patch(debug_backend_override=">=0:aot_eager"):
        yield


@pytest.mark.slow
def test_a_compiled_step_is_checked_and_measured_as_itself(gpt, single_thread, aot_eager):
    result = mixprec.check(gpt, policies=[STEP], steps=3, batch_size=4)
    verdict = result.candidates[0]
    assert verdict.candidate == STEP and verdict.label == "bf16-true+compile-step"
    assert verdict.verdict == "pass" and verdict.reason.startswith("matches fp32"), verdict.reason
    # measured whatever its speed (a prune factor nothing reaches): where bf16 is only emulated (an
    # AVX2-only CPU) its steps are about 8x strict fp32's, and a pruned row counts no graphs
    bench = mixprec.bench(
        gpt, candidates=[STEP], steps=2, warmup=1, batch_size=4, isolate=False, prune_factor=1e6
    )
    row = next(r for r in bench.rows if r.candidate == STEP)
    assert row.status == "ok" and row.graphs >= 2  # the forward's graph and the optimizer step's
    assert row.graph_breaks >= 1  # backward() splits the step, by design
    assert row.compile_s is not None


def test_the_step_scope_is_validated_where_the_candidate_enters():
    with pytest.raises(mixprec.PolicyError, match="without a compile mode"):
        Candidate("bf16-mixed", compile_scope="step")
    from mixprec.frameworks import framework_named

    torch_backend = framework_named("torch")
    with pytest.raises(mixprec.PolicyError, match="the step scope compiles the optimizer's update itself"):
        torch_backend.validate(
            Candidate("bf16-mixed", compile="default", compile_scope="step", optimizer="fused")
        )
    with pytest.raises(mixprec.PolicyError, match="Unknown PyTorch compile scope 'graph'"):
        torch_backend.validate(Candidate("bf16-mixed", compile="default", compile_scope="graph"))
    assert Candidate("fp32", compile="default", compile_scope="model") == Candidate("fp32", compile="default")
