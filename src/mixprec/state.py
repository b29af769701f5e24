"""Read, set and restore PyTorch's global fp32-precision state.

PyTorch 2.9 replaced ``allow_tf32`` / ``set_float32_matmul_precision`` with per-backend
``fp32_precision`` properties. Mixing the two makes later reads raise a RuntimeError
(pytorch/pytorch#179445), so this module uses exactly one of them: the new API when the
running torch has it, the legacy flags otherwise. Nothing here runs at import time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# The (backend module path, op) pairs whose fp32 math a policy controls.
# "cuda" covers cuBLAS matmuls, "cudnn" the cuDNN convolutions and RNNs, "mkldnn" oneDNN on CPU.
PRECISION_KNOBS: tuple[tuple[str, str], ...] = (
    ("cuda", "matmul"),
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)


def has_fp32_precision_api() -> bool:
    """True when this torch has the per-backend ``fp32_precision`` API (torch >= 2.9)."""
    return hasattr(torch.backends, "fp32_precision") and hasattr(torch.backends.cudnn, "conv")


@dataclass(frozen=True)
class PrecisionSettings:
    """fp32 math mode per compute library: 'ieee' (strict), 'tf32' or 'bf16' (reduced internally).

    ``None`` leaves that library as it is.
    """

    cuda_matmul: str | None = None
    cudnn: str | None = None  # conv and rnn
    mkldnn: str | None = None  # matmul, conv and rnn on CPU

    def per_knob(self) -> dict[tuple[str, str], str]:
        wanted = {"cuda": self.cuda_matmul, "cudnn": self.cudnn, "mkldnn": self.mkldnn}
        return {knob: value for knob in PRECISION_KNOBS if (value := wanted[knob[0]]) is not None}


# torch.backends as an untyped module: fp32_precision and its per-backend knobs (torch >= 2.9) are
# set at run time, so type checkers do not know them.
_backends: Any = torch.backends


def _knob(backend: str, op: str) -> Any:
    return getattr(getattr(torch.backends, backend), op)


def _legacy_snapshot() -> dict[str, object]:
    return {
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _legacy_apply(snapshot: dict[str, object]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = bool(snapshot["cuda.matmul.allow_tf32"])
    torch.backends.cudnn.allow_tf32 = bool(snapshot["cudnn.allow_tf32"])
    torch.set_float32_matmul_precision(str(snapshot["float32_matmul_precision"]))


def _legacy_from_settings(settings: PrecisionSettings, current: dict[str, object]) -> dict:
    """Translate settings to the pre-2.9 flags (which cannot express everything the new API can)."""
    out = dict(current)
    if settings.cuda_matmul is not None:
        out["cuda.matmul.allow_tf32"] = settings.cuda_matmul == "tf32"
    if settings.cudnn is not None:
        out["cudnn.allow_tf32"] = settings.cudnn == "tf32"
    # The legacy matmul-precision knob drives both cuBLAS (tf32 = "high") and oneDNN (bf16 = "medium").
    if settings.mkldnn == "bf16":
        out["float32_matmul_precision"] = "medium"
    elif settings.cuda_matmul == "tf32":
        out["float32_matmul_precision"] = "high"
    elif settings.cuda_matmul is not None or settings.mkldnn is not None:
        out["float32_matmul_precision"] = "highest"
    return out


def snapshot() -> dict[str, object]:
    """Everything this module may change, as plain values (compare two snapshots to detect leaks)."""
    if has_fp32_precision_api():
        snap: dict[str, object] = {
            f"{backend}.{op}": _knob(backend, op).fp32_precision for backend, op in PRECISION_KNOBS
        }
        snap["generic"] = _backends.fp32_precision
    else:
        snap = _legacy_snapshot()
    snap["cudnn.benchmark"] = torch.backends.cudnn.benchmark
    snap["default_dtype"] = torch.get_default_dtype()
    return snap


def restore(snap: dict[str, object]) -> None:
    """Put back a :func:`snapshot` taken earlier in this process."""
    if has_fp32_precision_api():
        for backend, op in PRECISION_KNOBS:
            _knob(backend, op).fp32_precision = snap[f"{backend}.{op}"]
        _backends.fp32_precision = snap["generic"]
    else:
        _legacy_apply(snap)
    torch.backends.cudnn.benchmark = bool(snap["cudnn.benchmark"])
    torch.set_default_dtype(snap["default_dtype"])  # type: ignore[arg-type]


def apply(settings: PrecisionSettings) -> None:
    """Set the fp32 math modes in ``settings`` (no restore: use :func:`precision_settings`)."""
    if has_fp32_precision_api():
        for (backend, op), value in settings.per_knob().items():
            _knob(backend, op).fp32_precision = value
    else:
        _legacy_apply(_legacy_from_settings(settings, _legacy_snapshot()))


@contextmanager
def precision_settings(settings: PrecisionSettings) -> Iterator[None]:
    """Apply ``settings`` for the body and restore the previous state on exit, also on exceptions."""
    before = snapshot()
    try:
        apply(settings)
        yield
    finally:
        restore(before)


@contextmanager
def cudnn_benchmark(enabled: bool) -> Iterator[None]:
    """``torch.backends.cudnn.benchmark`` for the body, restored on exit.

    Benchmark mode times cuDNN's convolution algorithms on the first call of each shape and
    keeps the fastest, as NVIDIA's training recipes and timm's train.py enable it; TensorFlow
    autotunes the same way by default. It changes which algorithm runs, never the precision.
    """
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def effective_state() -> dict[str, object]:
    """The fp32 math mode each library will use now, read through the API in use, for reports."""
    state: dict[str, object] = {"api": "fp32_precision" if has_fp32_precision_api() else "legacy"}
    if has_fp32_precision_api():
        generic = _backends.fp32_precision
        for backend, op in PRECISION_KNOBS:
            value = _knob(backend, op).fp32_precision
            # "none" means "inherit": from the backend-wide value, then from the generic one.
            if value == "none":
                value = getattr(getattr(torch.backends, backend), "fp32_precision", "none")
            if value == "none":
                value = generic if generic != "none" else "ieee"
            state[f"{backend}.{op}"] = value
    else:
        legacy = _legacy_snapshot()
        state["cuda.matmul"] = "tf32" if legacy["cuda.matmul.allow_tf32"] else "ieee"
        state["cudnn.conv"] = "tf32" if legacy["cudnn.allow_tf32"] else "ieee"
        state["float32_matmul_precision"] = legacy["float32_matmul_precision"]
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        # cuBLAS and cuDNN then refuse TF32 whatever torch asks for (measured on an H100: a TF32
        # request returns the strict result bit for bit), so the effective mode is IEEE.
        for key, value in state.items():
            if key.startswith(("cuda.", "cudnn.")) and value == "tf32":
                state[key] = "ieee (NVIDIA_TF32_OVERRIDE=0)"
    state["cudnn.benchmark"] = torch.backends.cudnn.benchmark
    state["NVIDIA_TF32_OVERRIDE"] = os.environ.get("NVIDIA_TF32_OVERRIDE")
    return state
