"""`mixprec train`'s loop takes a Candidate and applies it whole, as a training loop does: its
policy, its optimizer implementation, its micro-batches accumulated per optimizer step, and its
compile mode at its scope (the model, or the whole step)."""

from __future__ import annotations

import math

import pytest
import torch
from monitor_faults import mlp

import mixprec
import mixprec.monitor.train as train_module
from mixprec import Candidate
from mixprec.errors import PolicyError, UsageError
from mixprec.monitor import MonitorConfig
from mixprec.monitor.train import train

EVERY = MonitorConfig(every=10)


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def test_a_policy_name_is_the_candidate_of_that_policy():
    by_name = train(mlp(), "bf16-mixed", 20, config=EVERY)
    whole = train(mlp(), Candidate("bf16-mixed"), 20, config=EVERY)
    assert by_name.losses == whole.losses and by_name.policy == "bf16-mixed"
    assert whole.candidate == Candidate("bf16-mixed").to_dict() and whole.sample_steps == [0, 10]


def test_micro_batches_are_accumulated_into_one_optimizer_step():
    w = mlp()
    sizes = []
    make_batch = w.make_batch
    w.make_batch = lambda b, device: sizes.append(b) or make_batch(b, device)  # type: ignore[method-assign]
    optimizer_steps = []
    make_optimizer = w.make_optimizer

    def counted(model):
        optimizer = make_optimizer(model)
        optimizer.register_step_post_hook(lambda *a: optimizer_steps.append(1))
        return optimizer

    w.make_optimizer = counted  # type: ignore[method-assign]
    result = train(w, Candidate("fp32", micro_batch=8, accumulation_steps=3), 5, config=EVERY, batch_size=99)
    assert sizes == [8] * 15 and len(optimizer_steps) == 5  # 3 micro-batches of 8 per step
    assert len(result.losses) == 5 and all(math.isfinite(v) for v in result.losses)
    assert result.policy == "fp32@8x3"


def test_the_candidates_optimizer_implementation_is_the_one_that_steps(monkeypatch):
    built, steps = [], []
    original = train_module.with_implementation

    def spy(optimizer, implementation):
        built.append(original(optimizer, implementation))
        built[-1].register_step_post_hook(lambda *a: steps.append(1))
        return built[-1]

    monkeypatch.setattr(train_module, "with_implementation", spy)
    result = train(mlp(), Candidate("bf16-mixed", optimizer="foreach"), 12, config=EVERY)
    assert built[0].defaults["foreach"] is True and len(steps) == 12  # the one that stepped
    assert result.policy == "bf16-mixed+foreach"


def test_the_compile_scope_says_what_is_compiled(monkeypatch):
    compiled = []

    def fake_compile(obj, mode=None):
        compiled.append((type(obj).__name__, mode))
        return obj

    monkeypatch.setattr(torch, "compile", fake_compile)
    train(mlp(), Candidate("bf16-mixed", compile="default"), 3, config=EVERY)
    train(mlp(), Candidate("bf16-mixed", compile="max-autotune-no-cudagraphs", compile_scope="step"), 3)
    assert compiled == [("Sequential", "default"), ("function", "max-autotune-no-cudagraphs")]


@pytest.mark.slow
@pytest.mark.parametrize("scope", [None, "step"])
def test_a_compiled_run_is_watched_as_the_eager_one(scope):
    eager = train(mlp(), Candidate("bf16-mixed"), 30, config=EVERY)
    compiled = train(mlp(), Candidate("bf16-mixed", compile="default", compile_scope=scope), 30, config=EVERY)
    assert not compiled.stopped and compiled.findings == [] and compiled.sample_steps == [0, 10, 20]
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-3)


@pytest.mark.parametrize(
    ("candidate", "error", "message"),
    [
        (Candidate("fp32", emulate="bf16"), UsageError, "emulated formats are check's"),
        (Candidate("bf16-mixed", compile="default", compile_scope="step", optimizer="fused"), PolicyError,
         "the step scope compiles the optimizer's update itself"),
    ],
)  # fmt: skip
def test_a_candidate_no_run_can_take_is_one_line(candidate, error, message):
    with pytest.raises(error, match=message):
        train(mlp(), candidate, 3)


def test_a_monitor_that_gives_up_ends_the_run_with_the_record_kept():
    w = mlp()
    w.optimizer_fn = lambda p: torch.optim.SGD(p, lr=1e-3)  # bf16 updates round away: a stall at once
    config = MonitorConfig(every=10, rescue=True, max_rescues=0)
    result = train(w, "bf16-true", 50, config=config)
    assert result.stopped.startswith("step 0: stall") and len(result.losses) == 1
    assert [f["kind"] for f in result.findings] == ["stall", "stop"] and not result.healthy
    assert mixprec.Candidate.from_dict(result.candidate) == Candidate("bf16-true")
