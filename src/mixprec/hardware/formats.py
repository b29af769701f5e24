"""How fast each half format really is here, measured: "native" from a CPU flag is not "fast".

A CPU flag says the instructions exist, not that oneDNN has a fast kernel for every op: on a Xeon
with AVX512-FP16 and AMX-FP16, fp16 matmuls are fast while an fp16 convolution took ~35x fp32's time.
So on a CPU each format's matmul and convolution rates are measured once (a probe of about a second,
cached with the MFU peaks: :func:`mixprec.hardware.peaks.cpu_peak`) and compared with fp32's. On a
GPU the datasheet's peaks stand in (there is no "flag but no kernel" gap there).
"""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.errors import UsageError
from mixprec.hardware.device import DeviceInfo
from mixprec.hardware.peaks import CPU_DTYPES, cpu_peak, peak_flops

# A format at under this share of fp32's rate is called slow here: running it costs more than it saves.
SLOW = 0.5


@dataclass(frozen=True)
class FormatSpeed:
    """One format's measured rate over fp32's on this device, per op (None: not measured)."""

    dtype_key: str
    matmul: float | None
    conv: float | None
    source: str

    def rate(self, conv: bool) -> float | None:
        """The rate that decides a model's speed: the convolutions' where it has them."""
        return self.conv if conv and self.conv is not None else self.matmul

    def slow(self, conv: bool) -> str | None:
        """Why this format is slow here for a model with (or without) convolutions, or None."""
        parts = [("matmuls", self.matmul)] + ([("convolutions", self.conv)] if conv else [])
        slow = [
            f"{op} run at {rate:.2f}x fp32's rate" for op, rate in parts if rate is not None and rate < SLOW
        ]
        return (
            f"{self.dtype_key} is slow on this device: {' and '.join(slow)} ({self.source})" if slow else None
        )

    def to_dict(self) -> dict[str, object]:
        return {"dtype": self.dtype_key, "matmul_vs_fp32": self.matmul, "conv_vs_fp32": self.conv}


def format_speed(info: DeviceInfo, dtype_key: str, *, conv: bool = True) -> FormatSpeed:
    """``dtype_key``'s (bf16, fp16) rate over fp32's on ``info``: measured once per CPU, then cached."""
    if info.type != "cpu":
        base, own = peak_flops(info, "fp32")[0], peak_flops(info, dtype_key)[0]
        ratio = own / base if base and own else None
        return FormatSpeed(dtype_key, ratio, ratio, "the datasheet's peaks")
    rates: dict[str, float | None] = {}
    for op in ("matmul", "conv") if conv else ("matmul",):
        if dtype_key not in CPU_DTYPES:  # fp8 / fp4: no CPU kernel to time
            rates[op] = None
            continue
        try:
            rates[op] = _ratio(dtype_key, info, op)
        except (RuntimeError, OSError, UsageError):
            rates[op] = None
    return FormatSpeed(dtype_key, rates.get("matmul"), rates.get("conv"), "measured on this CPU, cached")


def _ratio(dtype_key: str, info: DeviceInfo, op: str) -> float | None:
    # (each peak is measured once and cached: one taken while the machine was busy understates
    # it until `cpu_peak(..., refresh=True)` measures it again)
    base = cpu_peak("fp32", info, op=op)[0]
    return cpu_peak(dtype_key, info, op=op)[0] / base if base > 0 else None


def format_speeds(info: DeviceInfo, *, conv: bool = True) -> dict[str, FormatSpeed]:
    """bf16's and fp16's measured rates on ``info``."""
    return {key: format_speed(info, key, conv=conv) for key in ("bf16", "fp16")}


def slow_formats(formats: dict[str, str], info: DeviceInfo, *, conv: bool) -> list[str]:
    """One warning per entry of ``formats`` (a policy name -> its compute dtype key) whose format is
    slow here for a model with (or without) convolutions: said before a check or a run spends
    minutes in it."""
    warnings: list[str] = []
    speeds: dict[str, FormatSpeed] = {}
    for policy, key in formats.items():
        if key not in ("bf16", "fp16"):
            continue
        if key not in speeds:
            speeds[key] = format_speed(info, key, conv=conv)
        why = speeds[key].slow(conv)
        if why is not None:
            warnings.append(f"{policy}: {why}; its steps will take longer than strict fp32's")
    return warnings
