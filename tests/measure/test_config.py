"""BenchConfig: checked once when made, the one thing bench() and the sweeps under tune take, and
what a result records of its settings."""

from __future__ import annotations

from dataclasses import replace

import pytest

import mixprec
import mixprec.measure.sweep as sweep_module
from mixprec.errors import PolicyError, UsageError
from mixprec.measure.config import BenchConfig
from mixprec.policy import Candidate


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"steps": 0}, "steps must be an integer >= 1, got 0"),
        ({"warmup": True}, "warmup must be an integer >= 1, got True"),
        ({"batch_size": -2}, "batch_size must be an integer >= 1"),
        ({"min_time_s": -1.0}, "min_time_s must be a finite number of seconds >= 0"),
        ({"prune_factor": 1}, "prune_factor must be a number > 1"),
        ({"nproc": 0}, "nproc must be an integer >= 1"),
        ({"channels_last": "sometimes"}, "Invalid channels_last 'sometimes'; valid: off, on, both"),
        ({"compile": "yes"}, "Invalid compile 'yes'"),
        ({"candidates": ("bf16-mixed",)}, "candidates must be mixprec.Candidate objects"),
        ({"resume": "no"}, "resume must be True or False"),
        ({"accumulation_steps": 2, "nproc": 2}, "gradient accumulation on DDP ranks"),
    ],
)
def test_a_bad_setting_is_refused_when_the_config_is_made(fields, message):
    with pytest.raises(UsageError, match=message):
        BenchConfig(**fields)


def test_an_unknown_policy_is_refused_with_the_closest_name():
    with pytest.raises(PolicyError, match="bf16-mixed"):
        BenchConfig(policies="fp32,bf16-mix")


def test_replace_checks_again_and_policies_are_normalised():
    config = BenchConfig(policies=["fp32", "bf16"], candidates=[Candidate("bf16-mixed")])
    assert config.policies == ("fp32", "bf16") and config.policy_names == ["fp32", "bf16-mixed"]
    assert isinstance(config.candidates, tuple)
    with pytest.raises(UsageError, match="steps"):
        replace(config, steps=0)
    data = config.to_dict()
    assert data["policies"] == ["fp32", "bf16-mixed"] and data["candidates"] == ["bf16-mixed"]


def test_bench_takes_a_config_whole_or_field_by_field(monkeypatch):
    """The keyword API is a facade: bench(w, steps=3) measures what bench(w, BenchConfig(steps=3))
    does, and fields given beside a config replace its own."""
    seen = []
    monkeypatch.setattr(sweep_module, "run_sweep", lambda w, f, config, **kw: seen.append(config))
    workload = mixprec.load_workload("mlp")
    # (threads fixed: 'auto' times the step at 1..N threads, and a busy machine may answer otherwise)
    mixprec.bench(workload, policies="fp32,bf16-mixed", steps=3, device="cpu", threads=1)
    mixprec.bench(workload, BenchConfig(policies="fp32,bf16-mixed", steps=3, device="cpu", threads=1))
    mixprec.bench(
        workload, BenchConfig(policies="fp32,bf16-mixed", steps=9, device="cpu", threads=1), steps=3
    )
    assert seen[0] == seen[1] == seen[2]
    with pytest.raises(UsageError, match=r"bench\(\) has no setting 'stepz'. Did you mean 'steps'"):
        mixprec.bench(workload, stepz=3)  # a misspelt field is one clear line
