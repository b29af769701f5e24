"""The TensorFlow framework seam without TensorFlow: candidates, support and the import boundary."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from mixprec.errors import PolicyError
from mixprec.hardware.device import DeviceInfo
from mixprec.policy import Candidate


def test_tensorflow_candidates_take_xla_and_refuse_torch_axes():
    """The Keras backend states its axes: XLA as the compile mode, no channels_last, no optimizer
    implementations; torch's refuses XLA; an unknown framework lists the known ones."""
    from mixprec.errors import UsageError
    from mixprec.frameworks import framework_named

    keras, torch = framework_named("tensorflow"), framework_named("torch")
    cand = keras.candidate("bf16-mixed", compile="xla")
    assert cand.label == "bf16-mixed+xla" and Candidate.from_dict(cand.to_dict()) == cand
    assert cand != Candidate("bf16-mixed", compile=None, framework="tensorflow")
    with pytest.raises(PolicyError, match="valid: xla"):
        keras.candidate("fp32", compile="default")
    with pytest.raises(PolicyError, match="channels_last does not apply to Keras 3 on TensorFlow"):
        keras.candidate("fp32", channels_last=True)
    with pytest.raises(PolicyError, match="optimizer implementation"):
        keras.candidate("fp32", optimizer="fused")
    with pytest.raises(PolicyError, match=r"PyTorch compile mode 'xla'; valid: default"):
        torch.validate(Candidate("fp32", compile="xla"))  # xla is TensorFlow's
    with pytest.raises(UsageError, match="Unknown framework 'jax'; valid: torch, tensorflow"):
        framework_named("jax")


def test_keras_support_on_a_cpu():
    from mixprec.frameworks.keras.policy import keras_support

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
    """`import mixprec`, the package mixprec.frameworks.keras, the CLI parser and a torch command leave
    TensorFlow unimported (it is imported on first use by a TensorFlow command only)."""
    code = (
        "import sys\n"
        "import mixprec, mixprec.keras, mixprec.frameworks.keras, mixprec.cli\n"
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
    from mixprec.frameworks.keras import backend

    monkeypatch.setenv("KERAS_BACKEND", "jax")
    # as if TensorFlow and Keras were installed (the GPU image has neither: the message was about that)
    found = backend.importlib.util.find_spec
    monkeypatch.setattr(
        backend.importlib.util,
        "find_spec",
        lambda name, *a: object() if name in ("tensorflow", "keras") else found(name, *a),
    )
    with pytest.raises(UnsupportedError, match="KERAS_BACKEND='jax'"):
        backend.tf()


def test_lint_with_the_tensorflow_framework_is_one_line_and_exit_2(capsys):
    """lint's rules read PyTorch modules: a Keras workload gets a clear usage error, not a torch lint."""
    from mixprec.cli import main

    assert main(["lint", "--framework", "tensorflow", "--model", "resnet50"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        "lint has no rules for Keras 3 on TensorFlow models" in err and "check --framework tensorflow" in err
    )
    assert len(err.splitlines()) == 1


def test_tensorflow_start_up_chatter_is_silenced():
    """TensorFlow's import and first device query print absl/oneDNN/CUDA lines on stderr; a mixprec
    command shows none of them (unless the user set TF_CPP_MIN_LOG_LEVEL)."""
    from mixprec.frameworks.keras import backend

    if backend.missing():
        pytest.skip(backend.missing())
    code = (
        "from mixprec.frameworks.keras import backend\n"
        "tf = backend.tf()\n"
        "tf.config.list_physical_devices()\n"
        "print(float(tf.reduce_sum(tf.ones((2, 2)))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "4.0", done.stderr[-2000:]
    assert done.stderr == ""


def test_keras_rows_show_mfu_as_na_with_the_reason():
    """A Keras row has no FLOP count: its MFU cell says n/a (with why in mfu_note), never blank."""
    from mixprec.measure.results import BenchRow, assemble
    from mixprec.report.bench import _cells

    row = BenchRow("mlp", Candidate("fp32", framework="tensorflow"), "cpu", 8, "ok", step_times_ms=(5.0, 6.0))
    (assembled,) = assemble([row], None, {"fp32": (1e12, "measured")})
    assert assembled.mfu is None and assembled.mfu_note.startswith("MFU n/a: no FLOP count")
    assert _cells(assembled)["mfu"] == "n/a"
    # said once under the table when the whole result carries it, not once per row
    from rich.console import Console

    from mixprec.measure.results import NO_FLOPS_NOTE, BenchResult
    from mixprec.report.bench import bench_table

    result = BenchResult(
        workload="mlp",
        description="",
        device="cpu",
        batch_size=8,
        settings={},
        measured=[row, replace(row, batch_size=16)],
        notes=[NO_FLOPS_NOTE],
    )
    console = Console(width=400, record=True)
    console.print(bench_table(result))
    assert console.export_text().count("no FLOP count") == 1
