"""Every policy states every fact the rest of mixprec reads from its spec, and the facts agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mixprec
from mixprec.hardware.peaks import DTYPE_KEYS
from mixprec.numerics.limits import FORMATS
from mixprec.policy import POLICIES, Candidate, PolicySpec, Thresholds, spec_of
from mixprec.policy.registry import COMPUTE_FORMATS
from mixprec.status import TONES, Status

FACTS = [f.name for f in dataclasses.fields(PolicySpec)]


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_states_every_fact(name):
    spec = POLICIES[name]
    assert spec.name == name
    for fact in ("description", "compute_format", "peak_key", "rounding_format", "range_format"):
        assert isinstance(getattr(spec, fact), str) and getattr(spec, fact), (name, fact)
    # Lightning has a name for every policy but fp8 (its fp8 is Transformer Engine, not torchao)
    assert isinstance(spec.lightning, str) if spec.fp8_recipe is None else spec.lightning is None
    assert spec.compute_format in COMPUTE_FORMATS
    assert spec.peak_key in DTYPE_KEYS
    assert spec.rounding_format in FORMATS or spec.rounding_format == "fp32"
    assert spec.range_format in FORMATS or spec.range_format == "fp32"
    assert isinstance(spec.thresholds, Thresholds)
    assert spec.accelerate is None or spec.accelerate in ("no", "bf16", "fp16")
    assert spec.deepspeed is None or spec.deepspeed in ("bf16", "fp16", "torch_autocast")
    assert not (spec.autocast_dtype and spec.param_dtype), "mixed and true are exclusive"
    assert spec.loss_scaling == (spec.low_precision_dtype == torch.float16)
    assert spec.compute_dtype == (spec.low_precision_dtype or torch.float32)


def test_safety_ranks_order_the_vocabulary():
    ranks = [POLICIES[n].safety_rank for n in mixprec.POLICY_NAMES]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)


def test_compute_formats_match_the_dtypes():
    for spec in POLICIES.values():
        if spec.fp8_recipe is not None:
            assert spec.compute_format == "fp8" and spec.autocast_dtype is torch.bfloat16
        elif spec.low_precision_dtype is torch.bfloat16:
            assert spec.compute_format == "bf16"
        elif spec.low_precision_dtype is torch.float16:
            assert spec.compute_format == "fp16"
        else:
            assert spec.compute_format == spec.name  # fp32, tf32, bf32 name their math mode


def test_candidate_identity_and_round_trip():
    cand = Candidate("bf16", channels_last=True, keep_fp32=["head"])
    assert cand.policy == "bf16-mixed" and cand.keep_fp32 == ("head",)  # aliases and lists normalised
    assert cand == Candidate("bf16-mixed", True, ("head",)) and hash(cand) == hash(
        Candidate("bf16-mixed", True, ("head",))
    )
    assert cand.label == "bf16-mixed+cl+fp32[head]"
    assert cand.numerics == Candidate("bf16-mixed", keep_fp32=("head",))
    assert Candidate.from_dict(cand.to_dict()) == cand
    assert Candidate("fp32", emulate="bf16").label == "bf16 (emulated)"
    assert spec_of(cand.policy) is cand.spec
    policy = mixprec.get_policy(cand.policy, device="cpu", **cand.policy_options())
    assert policy.config.channels_last and policy.config.keep_fp32 == ("head",)


@pytest.mark.parametrize(
    "kwargs",
    [{"policy": "bf16-mix"}, {"policy": "fp32", "keep_fp32": 5}, {"policy": "fp32", "emulate": "fp16"}],
)
def test_bad_candidates_fail_with_the_valid_values(kwargs):
    with pytest.raises(mixprec.PolicyError, match="valid"):
        Candidate(**kwargs)


def test_every_status_has_a_tone():
    assert set(TONES) == set(Status)
