"""FLOPs of one training step, and the throughput / MFU figures derived from them."""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.flop_counter import FlopCounterMode


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs PyTorch's FlopCounterMode attributes to running ``fn`` once (matmuls, convs, attention).

    Elementwise ops, norms and optimizer updates count as zero, which is the usual MFU convention.
    A backward pass counts too: a Linear layer's backward is 2x its forward when the input needs a
    gradient and 1x when only the weight does.
    """
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def _usable(value: float | None) -> bool:
    return value is not None and value > 0


def achieved_tflops(flops_per_step: int | None, step_time_s: float | None) -> float | None:
    """Achieved TFLOP/s, or ``None`` when either input is missing or zero."""
    if not (_usable(flops_per_step) and _usable(step_time_s)):
        return None
    return flops_per_step / step_time_s / 1e12  # type: ignore[operator]


def mfu(flops_per_step: int | None, step_time_s: float | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation (0..1 in practice): achieved FLOP/s over peak FLOP/s.

    ``None`` when any input is missing or zero.
    """
    if not (_usable(flops_per_step) and _usable(step_time_s) and _usable(peak_flops)):
        return None
    return flops_per_step / step_time_s / peak_flops  # type: ignore[operator]
