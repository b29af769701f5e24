"""The figures derived from a step's FLOPs: achieved TFLOP/s and model FLOPs utilisation."""

from __future__ import annotations


def _usable(value: float | None) -> bool:
    return value is not None and value > 0


def achieved_tflops(flops_per_step: int | None, step_time_s: float | None) -> float | None:
    """Achieved TFLOP/s, or ``None`` when either input is missing or zero."""
    if not (_usable(flops_per_step) and _usable(step_time_s)):
        return None
    return flops_per_step / step_time_s / 1e12  # type: ignore[operator]


def mfu(flops_per_step: int | None, step_time_s: float | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over peak FLOP/s (above 1 means the peak or the
    FLOP count is wrong for this run: :func:`mixprec.measure.results.assemble` refuses to show it).

    ``None`` when any input is missing or zero.
    """
    if not (_usable(flops_per_step) and _usable(step_time_s) and _usable(peak_flops)):
        return None
    return flops_per_step / step_time_s / peak_flops  # type: ignore[operator]
