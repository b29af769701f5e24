"""The ``env`` block every mixprec JSON carries, and the data behind ``mixprec env``."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

from mixprec import state
from mixprec.hardware.device import detect
from mixprec.version import __version__

# The fields of ``torch.utils.collect_env`` that matter here, and the getter of each in that module.
_SYSTEM_FIELDS = {
    "os": "get_os",
    "gcc_version": "get_gcc_version",
    "cuda_runtime_version": "get_running_cuda_version",
    "nvidia_driver_version": "get_nvidia_driver_version",
    "nvidia_gpu_models": "get_gpu_info",
    "cpu_info": "get_cpu_info",
}


def _collect_env_fields() -> dict[str, Any]:
    """``_SYSTEM_FIELDS`` from collect_env's own getters (they shell out: slow, so only for env).
    ``get_env_info()`` also runs ``pip list`` and looks for conda, cmake, clang and cuDNN, for fields
    not kept here: 0.42 s against 0.02 s on a 2-core Xeon, spent by every ``mixprec env``. A torch
    whose getters were renamed gets the whole report, read for the same fields."""
    from torch.utils import collect_env

    if all(hasattr(collect_env, getter) for getter in (*_SYSTEM_FIELDS.values(), "run")):
        run = collect_env.run
        return {field: getattr(collect_env, getter)(run) for field, getter in _SYSTEM_FIELDS.items()}
    info = collect_env.get_env_info()  # pragma: no cover - (torch 2.14's collect_env has them all)
    return {field: getattr(info, field) for field in _SYSTEM_FIELDS}


def collect(device: str | torch.device | None = None, *, full: bool = False) -> dict[str, Any]:
    """Versions, device capabilities and the effective precision state.

    ``full`` adds the slower ``torch.utils.collect_env`` fields (OS, driver, CPU details).
    """
    info = detect(device)
    env: dict[str, Any] = {
        "mixprec_version": __version__,
        "python_version": sys.version.split()[0],
        "platform": platform.platform(),
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "cuda_available": torch.cuda.is_available(),
        "device": info.to_dict(),
        "threads": torch.get_num_threads(),
        "precision_state": state.effective_state(),
    }
    if full:
        env["system"] = _collect_env_fields()
    return env
