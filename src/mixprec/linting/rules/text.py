"""Wording the rule families share: how findings describe shapes and layers, and the
rationale note of the tensor-core rules."""

from __future__ import annotations

from typing import Any

from mixprec.linting.trace import ModuleRecord

CPU_NOTE = (
    " Tensor cores are NVIDIA hardware: on a CPU target this rule describes the GPU the model "
    "will likely train on and reports at info severity (oneDNN on a CPU blocks and pads by "
    "itself); lint --target cuda judges it at full severity."
)


def dims(shape: tuple[int, ...] | None) -> str:
    """``[8, 64]``, or '?' for an unknown shape."""
    return "[" + ", ".join(map(str, shape)) + "]" if shape else "?"


def layer_shape(rec: ModuleRecord, what: str) -> str:
    """``what`` with the shapes the layer ran with: 'Linear(64, 100) on [8, 64] -> [8, 100]'."""
    inp = dims(rec.input.shape) if rec.input else "?"
    out = dims(rec.output.shape) if rec.output else "?"
    return f"{what} on {inp} -> {out}"


def conv_desc(m: Any) -> str:
    """A convolution as its constructor call: 'Conv2d(32, 30, k=3x3)' (with groups if any)."""
    k = "x".join(map(str, m.kernel_size))
    groups = f", groups={m.groups}" if m.groups != 1 else ""
    return f"{type(m).__name__}({m.in_channels}, {m.out_channels}, k={k}{groups})"


__all__ = ["CPU_NOTE", "conv_desc", "dims", "layer_shape"]
