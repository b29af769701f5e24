"""The env block of TensorFlow runs: mixprec's own (versions, device, torch state) plus TensorFlow's
version, devices, TF32 state, oneDNN and bf16 on the CPU, and SURF's A100 guide's caveat as a fact:
TensorFlow does not honour ``NVIDIA_TF32_OVERRIDE``, it has its own switch."""

from __future__ import annotations

import os
from typing import Any

from mixprec.frameworks.keras import backend
from mixprec.hardware import environment
from mixprec.hardware.device import detect


def tensorflow_facts(device: str | None = None) -> dict[str, Any]:
    """TensorFlow's part of the env block (imports TensorFlow)."""
    tf, keras = backend.tf(), backend.keras()
    info = detect(device or "cpu")
    build = dict(tf.sysconfig.get_build_info())
    onednn_env = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    onednn = onednn_env != "0" if onednn_env is not None else _onednn_default()
    override = os.environ.get("NVIDIA_TF32_OVERRIDE")
    return {
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "built_with_cuda": bool(build.get("is_cuda_build")),
        "cuda_version": build.get("cuda_version"),
        "cudnn_version": build.get("cudnn_version"),
        "devices": [d.name for d in tf.config.list_physical_devices()],
        "tf32_execution_enabled": bool(tf.config.experimental.tensor_float_32_execution_enabled()),
        "global_dtype_policy": keras.mixed_precision.global_policy().name,
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "onednn_enabled": onednn,
        "onednn_bf16_on_cpu": bool(onednn and info.type == "cpu" and info.native_bf16),
        "nvidia_tf32_override": override,
        "nvidia_tf32_override_honoured": False,
        "tf32_note": (
            "TensorFlow ignores NVIDIA_TF32_OVERRIDE"
            + (f" (set to {override!r} here)" if override is not None else " (not set here)")
            + ": TF32 is switched by tf.config.experimental.enable_tensor_float_32_execution, on by "
            "default on Ampere and newer; mixprec's fp32 turns it off, tf32 on"
        ),
    }


def _onednn_default() -> bool:
    """TensorFlow turns its oneDNN optimisations on by default on x86 Linux (since 2.9)."""
    import platform

    return platform.machine().lower() in ("x86_64", "amd64")


def collect(device: str | None = None, *, full: bool = False) -> dict[str, Any]:
    """mixprec's env block with a ``tensorflow`` section."""
    tensorflow = tensorflow_facts(device)
    env = environment.collect("cuda" if str(device).startswith("cuda") else "cpu", full=full)
    env["framework"] = "tensorflow"
    env["tensorflow"] = tensorflow
    return env
