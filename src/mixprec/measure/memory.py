"""Peak memory as a model of the batch size: half the point of lower precision is that half-size
activations let a larger micro-batch fit, so each candidate's peak is measured at a few micro-batch
sizes on the real step (forward, backward, optimizer), fitted as ``fixed + per_sample * batch`` and
checked against a measured point the fit did not see. A memory budget then gives each candidate's
largest safe micro-batch.

How a peak is measured is the framework's (:meth:`Framework.peak_memory`): torch reads
``torch.cuda.max_memory_allocated`` on a GPU and, on a CPU (which keeps no allocator statistics),
the tensor bytes alive at the step's peak, tracked by ``torch.distributed._tools.MemTracker``
(parameters, gradients, optimizer state, activations and temporaries, as the CUDA allocator would
be asked for them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mixprec import validation
from mixprec.errors import UsageError
from mixprec.frameworks.session import MemoryPoint


def parse_size(text: str | int | float) -> int:
    """Bytes from ``'8GiB'``, ``'512MB'``, ``'2g'`` or a number of bytes (binary units: a GB here is
    a GiB, as ``nvidia-smi`` and PyTorch's allocator count): :func:`mixprec.validation.byte_size`."""
    return validation.byte_size("--memory-budget", text)


@dataclass
class MemoryModel:
    """``peak(batch) = fixed_bytes + per_sample_bytes * batch``, fitted on ``points``.

    Attributes:
        check: a measured point the fit did not use; ``check_error`` the fit's relative error there.
    """

    label: str
    fixed_bytes: float
    per_sample_bytes: float
    points: list[MemoryPoint]
    check: MemoryPoint | None = None
    check_error: float | None = None

    def predict(self, batch_size: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def max_batch(self, budget_bytes: int, *, multiple: int = 1, limit: int = 1 << 20) -> int | None:
        """The largest micro-batch (a multiple of ``multiple``) whose predicted peak fits
        ``budget_bytes``; None when not even ``multiple`` samples fit."""
        room = budget_bytes - self.fixed_bytes
        if room < self.per_sample_bytes * multiple:
            return None
        if self.per_sample_bytes <= 0:
            return limit - limit % multiple  # no growth measured: the budget does not bind
        most = min(limit, int(room // self.per_sample_bytes))
        return most - most % multiple or None

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "fixed_bytes": self.fixed_bytes,
            "per_sample_bytes": self.per_sample_bytes,
            "points": [p.to_dict() for p in self.points],
            "check": self.check.to_dict() if self.check else None,
            "check_error": self.check_error,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryModel:
        return cls(
            str(data["label"]),
            float(data["fixed_bytes"]),
            float(data["per_sample_bytes"]),
            [MemoryPoint.from_dict(p) for p in data.get("points") or []],
            MemoryPoint.from_dict(data["check"]) if data.get("check") else None,
            data.get("check_error"),
        )


def fit(label: str, points: Sequence[MemoryPoint], check: MemoryPoint | None = None) -> MemoryModel:
    """Least squares of ``peak = a + b * batch`` over ``points`` (two distinct batch sizes at least),
    then its relative error at ``check``."""
    sizes = {p.batch_size for p in points}
    if len(sizes) < 2:
        raise UsageError(
            f"a memory model needs peaks at two batch sizes at least, got {sorted(sizes)}; pass more "
            "batch sizes."
        )
    n = len(points)
    mean_x = sum(p.batch_size for p in points) / n
    mean_y = sum(p.peak_bytes for p in points) / n
    sxx = sum((p.batch_size - mean_x) ** 2 for p in points)
    sxy = sum((p.batch_size - mean_x) * (p.peak_bytes - mean_y) for p in points)
    slope = sxy / sxx
    model = MemoryModel(label, mean_y - slope * mean_x, slope, list(points))
    if check is not None:
        model.check = check
        model.check_error = model.predict(check.batch_size) / check.peak_bytes - 1.0
    return model


def fit_and_check(label: str, points: Sequence[MemoryPoint]) -> MemoryModel:
    """Fit on every point but the smallest batch, checked on that one (three points or more); with
    two points, fitted on both and unchecked. The largest sizes lead because the budget binds up
    there, where activations dominate: at a small batch the peak can sit elsewhere (the optimizer
    step over the weights), so the peak is a convex curve and a line through the small sizes would
    promise a larger batch than fits."""
    ordered = sorted(points, key=lambda p: p.batch_size)
    if len(ordered) >= 3:
        return fit(label, ordered[1:], ordered[0])
    return fit(label, ordered)
