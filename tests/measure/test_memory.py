"""Peak memory as a model of the batch size (mixprec.measure.memory) and torch's measurement of it
(Framework.peak_memory): the fit, the budget's largest batch, sizes as users write them, and the
tracked peak of a real step against the bytes it must hold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.errors import UsageError
from mixprec.frameworks import framework_of
from mixprec.frameworks.session import MemoryPoint
from mixprec.measure.memory import MemoryModel, fit, fit_and_check, parse_size


def point(batch, peak):
    return MemoryPoint(batch, int(peak))


def test_the_fit_recovers_a_line_and_reports_its_error_at_the_check():
    points = [point(b, 1000 + 64 * b) for b in (4, 8, 16)]
    model = fit("x", points[1:], points[0])
    assert model.fixed_bytes == pytest.approx(1000) and model.per_sample_bytes == pytest.approx(64)
    assert model.check_error == pytest.approx(0.0)
    bent = fit_and_check("x", [point(4, 2000), point(8, 2100), point(16, 3100)])  # convex: peak moved
    # fitted where the budget binds (the large sizes); the small size's peak sits above that line
    assert bent.check.batch_size == 4 and bent.check_error == pytest.approx(1600 / 2000 - 1)
    assert bent.predict(32) == pytest.approx(3100 + 16 * 125)  # the line of the large sizes


def test_the_largest_batch_within_a_budget():
    model = MemoryModel("x", fixed_bytes=1000, per_sample_bytes=100, points=[])
    assert model.max_batch(1000 + 100 * 37) == 37
    assert model.max_batch(1000 + 100 * 37, multiple=8) == 32
    assert model.max_batch(1050) is None  # not one sample fits
    assert MemoryModel("x", 1000, 0.0, []).max_batch(2000, limit=4096) == 4096  # no growth: no bound


def test_one_batch_size_is_no_model():
    with pytest.raises(UsageError, match=r"two batch sizes at least, got \[8\]"):
        fit("x", [point(8, 1), point(8, 2)])


@pytest.mark.parametrize(
    ("text", "size"),
    [("8GiB", 8 * 2**30), ("512MB", 512 * 2**20), ("1.5g", int(1.5 * 2**30)), ("4096", 4096), (2**20, 2**20)],
)
def test_sizes_as_users_write_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["eight gigs", "-1GiB", "0", "8XB", True])
def test_a_bad_size_names_itself_and_the_form(text):
    with pytest.raises(UsageError, match=r"memory size|must be"):
        parse_size(text)


def _mlp_workload(width=256):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
    return mixprec.Workload(
        model=model,
        make_batch=lambda b, d: (torch.randn(b, 64, device=d), torch.randint(0, 10, (b,), device=d)),
        loss_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
        optimizer_fn=lambda p: torch.optim.Adam(p, lr=1e-3),
        name="mlp",
    )


def test_the_tracked_peak_holds_weights_gradients_adam_state_and_grows_with_the_batch():
    w = _mlp_workload(width=1024)
    framework = framework_of(w)
    weights = sum(p.numel() for p in w.model.parameters()) * 4
    small = framework.peak_memory(w, framework.candidate("fp32"), "cpu", 8)
    large = framework.peak_memory(w, framework.candidate("fp32"), "cpu", 512)
    # at a small batch the peak is the optimizer step: weights, gradients, Adam's two moments
    assert small.peak_bytes >= 4 * weights
    assert small.parts["Parameter"] >= weights and small.parts["Optstate"] >= 2 * weights
    # at a large one, the activations: 1024 fp32 hidden values a sample at least
    assert large.peak_bytes - small.peak_bytes >= 504 * 1024 * 4
    assert large.parts["Activation"] >= 512 * 1024 * 4
    assert "MemTracker" in small.method
    half = framework.peak_memory(w, framework.candidate("bf16-true"), "cpu", 512)
    assert half.peak_bytes < 0.6 * large.peak_bytes  # half the bytes for every tensor, near enough


def test_a_compiled_candidate_is_measured_by_its_eager_twin_on_a_cpu():
    w = _mlp_workload()
    framework = framework_of(w)
    compiled = framework.validate(mixprec.Candidate("fp32", compile="default"))
    got = framework.peak_memory(w, compiled, "cpu", 8)
    assert "eager twin" in got.method
    assert got.peak_bytes == framework.peak_memory(w, framework.candidate("fp32"), "cpu", 8).peak_bytes
