"""The ``env`` block every mixprec JSON carries, and the data behind ``mixprec env``."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

from mixprec import state
from mixprec.hardware.device import detect
from mixprec.version import __version__


def _collect_env_fields() -> dict[str, Any]:
    """The fields of ``torch.utils.collect_env`` that matter here (it shells out: slow, so only for env)."""
    from torch.utils import collect_env

    info = collect_env.get_env_info()
    return {
        "os": info.os,
        "gcc_version": info.gcc_version,
        "cuda_runtime_version": info.cuda_runtime_version,
        "nvidia_driver_version": info.nvidia_driver_version,
        "nvidia_gpu_models": info.nvidia_gpu_models,
        "cpu_info": info.cpu_info,
    }


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
