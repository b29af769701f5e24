"""The TensorFlow framework seam without TensorFlow: candidates, support and the import boundary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mixprec.errors import PolicyError
from mixprec.hardware.device import DeviceInfo
from mixprec.policy import Candidate


def test_tensorflow_candidates_take_xla_and_refuse_torch_axes():
    cand = Candidate("bf16-mixed", compile="xla", framework="tensorflow")
    assert cand.label == "bf16-mixed+xla" and Candidate.from_dict(cand.to_dict()) == cand
    assert cand != Candidate("bf16-mixed", compile=None, framework="tensorflow")
    with pytest.raises(PolicyError, match="valid: xla"):
        Candidate("fp32", compile="default", framework="tensorflow")
    with pytest.raises(PolicyError, match="NHWC already"):
        Candidate("fp32", channels_last=True, framework="tensorflow")
    with pytest.raises(PolicyError, match="optimizer implementation"):
        Candidate("fp32", optimizer="fused", framework="tensorflow")
    with pytest.raises(PolicyError, match=r"torch\.compile mode"):
        Candidate("fp32", compile="xla")  # xla is TensorFlow's
    with pytest.raises(PolicyError, match="valid: torch, tensorflow"):
        Candidate("fp32", framework="jax")


def test_keras_support_on_a_cpu():
    from mixprec.keras.policy import keras_support

    bf16_cpu = DeviceInfo("cpu", "cpu", cpu_flags=frozenset({"avx512_bf16"}))
    plain_cpu = DeviceInfo("cpu", "cpu")

    def support(policy, info):
        return keras_support(Candidate(policy, framework="tensorflow"), info)

    assert support("fp32", plain_cpu).native
    assert not support("tf32", bf16_cpu) and not support("bf32", bf16_cpu)
    assert support("bf16-mixed", bf16_cpu).native and not support("bf16-mixed", plain_cpu).native
    fp16 = support("fp16-mixed", bf16_cpu)
    assert fp16 and not fp16.native and fp16.suggestion == "bf16-mixed"
    assert support("tf32", DeviceInfo("cuda", "A100", capability=(8, 0)))


def test_every_policy_states_its_keras_dtype_policy():
    from mixprec.policy import POLICIES

    named = {name: spec.keras for name, spec in POLICIES.items()}
    assert named["fp16-mixed"] == "mixed_float16" and named["bf16-mixed"] == "mixed_bfloat16"
    assert named["bf16-true"] == "bfloat16" and named["fp16-true"] == "float16"
    assert named["fp32"] == named["tf32"] == "float32" and named["bf32"] is None


def test_mixprec_and_torch_commands_never_import_tensorflow():
    """`import mixprec`, the package mixprec.keras, the CLI parser and a torch command leave
    TensorFlow unimported (it is imported on first use by a TensorFlow command only)."""
    code = (
        "import sys\n"
        "import mixprec, mixprec.keras, mixprec.cli\n"
        "from mixprec.cli import build_parser, main\n"
        "build_parser().parse_args(['bench', '--framework', 'tensorflow'])\n"
        "assert main(['env']) == 0\n"
        "loaded = [m for m in ('tensorflow', 'keras') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


def test_tensorflow_missing_is_a_clear_unsupported_error(monkeypatch):
    from mixprec.errors import UnsupportedError
    from mixprec.keras import backend

    monkeypatch.setenv("KERAS_BACKEND", "jax")
    with pytest.raises(UnsupportedError, match="KERAS_BACKEND='jax'"):
        backend.tf()
