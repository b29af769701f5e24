"""What a low format would buy one Linear layer on a named GPU: a roofline estimate, not a measurement.

In the spirit of torchao's ``float8_roofline.py``: a Linear's training step is three GEMMs of
``2*M*K*N`` FLOPs each (M tokens, K in features, N out features). In bf16 each GEMM takes the
longer of its math at the bf16 peak and its operands' and output's bytes at the memory bandwidth.
In a low format the GEMMs run at the format's peak on 1-byte (fp8) or half-byte (fp4) operands
plus their scales, and the casts that make those operands cost memory traffic of their own: each
of x, W and dy is read once in bf16 and written in the format twice (once per GEMM that reduces
over a different dimension; one fused cast kernel, as torch.compile makes it). A small layer whose
casts cost more than its GEMMs save is slower in the low format: the layers torchtitan's
``auto_filter_small_kn`` leaves in bf16.

The peaks are the dense figures of :data:`mixprec.hardware.peaks.GPU_PEAKS`; the bandwidths
below are the datasheets' HBM figures. Kernel launch and efficiency below the roofline are not
modelled, so the figures are upper bounds on what the format can gain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mixprec.errors import UsageError
from mixprec.hardware.peaks import GPU_PEAKS

# The GPUs this module knows: a CUDA device name GPU_PEAKS matches, and its HBM bandwidth (bytes/s)
# from the same datasheets.
_GPUS = {
    "H100": ("NVIDIA H100 80GB HBM3", 3.35e12),
    "H200": ("NVIDIA H200", 4.8e12),
    "B200": ("NVIDIA B200", 8.0e12),
}
PEAK_KEY = {"bf16": "bf16", "fp8": "fp8", "mxfp8": "fp8", "nvfp4": "fp4"}  # the GEMMs' peak per format
ELEMENT_BYTES = {"fp8": 1.0, "mxfp8": 1.0 + 1.0 / 32, "nvfp4": 0.5 + 1.0 / 16}  # element + its block scale
DEFAULT_GPU = {"fp8": "H100", "mxfp8": "B200", "nvfp4": "B200"}
# The GPUs whose tensor cores run each format (the block formats are Blackwell's).
RUNS_ON = {
    "bf16": ("H100", "H200", "B200"),
    "fp8": ("H100", "H200", "B200"),
    "mxfp8": ("B200",),
    "nvfp4": ("B200",),
}


@dataclass(frozen=True)
class LinearEstimate:
    """One Linear's training GEMMs in bf16 and in the format, in seconds, on ``gpu``."""

    gpu: str
    bf16_s: float
    low_s: float

    @property
    def speedup(self) -> float:
        return self.bf16_s / self.low_s


def _peak(gpu: str, fmt: str) -> float | None:
    """FLOP/s of ``fmt``'s GEMMs on ``gpu``, from the datasheet table; None where it has none."""
    if gpu not in RUNS_ON.get(fmt, ()):
        return None
    device = _GPUS[gpu][0]
    for entry in GPU_PEAKS:
        if entry.dtype_key == PEAK_KEY[fmt] and re.search(entry.device_pattern, device, re.IGNORECASE):
            return entry.tflops * 1e12
    return None


def _gemm_s(m: int, k: int, n: int, peak: float, operand_bytes: float, bandwidth: float) -> float:
    math_s = 2.0 * m * k * n / peak
    memory_s = ((m * k + k * n) * operand_bytes + m * n * 2.0) / bandwidth  # output in bf16
    return max(math_s, memory_s)


def estimate(m: int, k: int, n: int, fmt: str, gpu: str | None = None) -> LinearEstimate:
    """The roofline of a Linear of ``k`` in and ``n`` out features over ``m`` tokens, forward and
    backward, in bf16 and in ``fmt`` ("fp8", "mxfp8", "nvfp4") on ``gpu`` (default: the format's
    first GPU, H100 for fp8, B200 for the block formats)."""
    if fmt not in ELEMENT_BYTES:
        raise UsageError(
            f"no roofline for format {fmt!r}; known formats: {', '.join(ELEMENT_BYTES)} (each against bf16)."
        )
    gpu = gpu or DEFAULT_GPU[fmt]
    bf16, low = _peak(gpu, "bf16"), _peak(gpu, fmt)
    if bf16 is None or low is None:
        known = [g for g in _GPUS if _peak(g, fmt) is not None]
        raise UsageError(
            f"no roofline for {fmt!r} on {gpu!r}; known GPUs for it: {', '.join(known) or 'none'}. "
            "Name one of those."
        )
    bw = _GPUS[gpu][1]
    shapes = ((m, k, n), (m, n, k), (n, m, k))  # forward, dgrad, wgrad: (rows, reduction, cols)
    bf16_s = sum(_gemm_s(a, b, c, bf16, 2.0, bw) for a, b, c in shapes)
    gemm_s = sum(_gemm_s(a, b, c, low, ELEMENT_BYTES[fmt], bw) for a, b, c in shapes)
    # each of x (m*k), W (k*n), dy (m*n): read once in bf16 and written in the format twice (one cast
    # kernel writing both layouts, as torch.compile fuses them)
    cast_s = (m * k + k * n + m * n) * (2.0 + 2 * ELEMENT_BYTES[fmt]) / bw
    return LinearEstimate(gpu, bf16_s, gemm_s + cast_s)
