"""Bad inputs raise the documented exception type with a message that names the problem and the fix."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import mixprec


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _prepare(name: str, model) -> None:
    mixprec.get_policy(name, device="cpu").prepare(model)


def _step(value=None, **clip) -> None:
    policy = mixprec.get_policy("bf16-mixed", device="cpu")
    model = policy.prepare(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy.step(opt if value is None else value, **clip)


CASES = [
    pytest.param(
        lambda: mixprec.get_policy("bf16-mix", device="cpu"),
        mixprec.PolicyError,
        "Did you mean 'bf16-mixed'",
        id="unknown-policy",
    ),
    pytest.param(
        lambda: mixprec.get_policy(3, device="cpu"), mixprec.PolicyError, "must be a string", id="non-string"
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp16-mixed", device="cpu", growth_factor=1.0),
        mixprec.PolicyError,
        "growth_factor",
        id="growth_factor",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp16-mixed", device="cpu", backoff_factor=1.5),
        mixprec.PolicyError,
        "backoff_factor=1.5",
        id="backoff_factor",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp16-mixed", device="cpu", growth_interval=0),
        mixprec.PolicyError,
        "growth_interval=0",
        id="growth_interval",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp16-mixed", device="cpu", init_scale=-1),
        mixprec.PolicyError,
        "init_scale=-1",
        id="init_scale",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp16-mixed", device="cpu", init_scale=256.0, min_scale=512.0),
        mixprec.PolicyError,
        "min_scale=512.0",
        id="min_scale-above-init",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp16-true", device="cpu", max_skips_at_min_scale=0),
        mixprec.PolicyError,
        "max_skips_at_min_scale",
        id="max_skips",
    ),
    pytest.param(
        lambda: mixprec.get_policy("bf16-mixed", device="cpu", init_scale=1024.0),
        mixprec.PolicyError,
        "fp16-mixed",
        id="scaler-option-on-bf16",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp16-mixed", device="cpu", channel_last=True),
        mixprec.PolicyError,
        "Did you mean 'channels_last'",
        id="unknown-option",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp32", device="cpu", channels_last="yes"),
        mixprec.PolicyError,
        "channels_last must be True or False",
        id="channels_last-not-bool",
    ),
    pytest.param(
        lambda: mixprec.get_policy("tf32", device="cpu"),
        mixprec.UnsupportedError,
        "compute capability",
        id="tf32-on-cpu",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp32", device="tpu"), mixprec.UsageError, "'tpu'", id="device-tpu"
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp32", device="cuda"),
        mixprec.UsageError,
        "--device cpu",
        id="cuda-unavailable",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here"),
    ),
    pytest.param(
        lambda: _prepare("fp16-mixed", "not a module"),
        mixprec.PolicyError,
        "takes a torch.nn.Module, got str",
        id="prepare-non-module",
    ),
    pytest.param(
        lambda: _prepare("fp16-mixed", _mlp().half()),
        mixprec.PolicyError,
        "model.float()",
        id="prepare-half-model",
    ),
    pytest.param(
        lambda: _prepare("bf16-mixed", _mlp().bfloat16()),
        mixprec.PolicyError,
        "'0.weight'",
        id="prepare-bf16-model",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp32", device="cpu", keep_fp32=["0"]),
        mixprec.PolicyError,
        "keep_fp32 has no effect under 'fp32'",
        id="keep_fp32-under-fp32",
    ),
    pytest.param(
        lambda: mixprec.get_policy("fp16-mixed", device="cpu", keep_fp32=[3]),
        mixprec.PolicyError,
        "keep_fp32 must be a list",
        id="keep_fp32-not-strings",
    ),
    pytest.param(
        lambda: _step("not an optimizer"),
        mixprec.PolicyError,
        "torch.optim.Optimizer",
        id="step-non-optimizer",
    ),
    pytest.param(lambda: _step([]), mixprec.PolicyError, "torch.optim.Optimizer", id="step-empty-list"),
    pytest.param(
        lambda: _step(clip_grad_norm=-1),
        mixprec.PolicyError,
        "clip_grad_norm must be a finite number > 0",
        id="clip-norm",
    ),
    pytest.param(
        lambda: _step(clip_grad_norm=float("nan")),
        mixprec.PolicyError,
        "clip_grad_norm must be a finite number > 0 or None, got nan",
        id="clip-norm-nan",
    ),
    pytest.param(
        lambda: _step(clip_grad_value=0),
        mixprec.PolicyError,
        "clip_grad_value must be a finite number > 0",
        id="clip-value",
    ),
]


@pytest.mark.parametrize(("call", "exc_type", "fragment"), CASES)
def test_bad_input(call, exc_type, fragment):
    with pytest.raises(exc_type, match=re.escape(fragment)):
        call()


@pytest.mark.parametrize("exc_type", [mixprec.PolicyError, mixprec.UsageError])
def test_input_errors_are_value_errors(exc_type):
    assert issubclass(exc_type, ValueError)
    assert issubclass(exc_type, mixprec.MixprecError)


def test_policy_error_caught_as_value_error():
    with pytest.raises(ValueError, match=re.escape("Unknown policy 'nope'")):
        mixprec.get_policy("nope", device="cpu")


def test_exit_codes_distinguish_error_kinds():
    codes = {
        cls: cls.exit_code
        for cls in (mixprec.PolicyError, mixprec.UnsupportedError, mixprec.ScaleCollapseError)
    }
    assert len(set(codes.values())) == 3
    assert all(code != 0 for code in codes.values())


def test_unsupported_policy_builds_with_check_false():
    policy = mixprec.get_policy("tf32", device="cpu", check=False)
    assert policy.name == "tf32"
    assert not policy.check_support()
