"""How fast each half format really is here, measured: "native" from a CPU flag is not "fast".

A CPU flag says the instructions exist, not that oneDNN has a fast kernel for every op: on a Xeon
with AVX512-FP16 and AMX-FP16, fp16 matmuls are fast while an fp16 convolution took ~35x fp32's time.
So on a CPU each format's matmul and convolution rates are measured once against fp32's, in
alternation (fp32, the format, fp32, ...; the ratio is the median of the rounds'), and cached. Two
peaks taken apart (one of them while a neighbour was busy) can call a fast format slow for good; a
load that comes and goes slows both sides of a round alike. On a GPU the datasheet's peaks stand in
(there is no "flag but no kernel" gap there).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mixprec.errors import UsageError
from mixprec.files import atomic_write_text
from mixprec.hardware.device import DeviceInfo
from mixprec.hardware.peaks import CPU_DTYPES, CPU_TORCH_DTYPES, cache_key, default_cache_dir, peak_flops

# A format at under this share of fp32's rate is called slow here: running it costs more than it saves.
SLOW = 0.5
# Alternating rounds of the probe (each the best of a few calls on each side).
ROUNDS = 5
_CALLS = 3
_SLOW_CALL_S = 0.2  # a call this slow is timed once per round: the probe stays around a second
_CACHE = "format_rates.json"
_CACHE_VERSION = 1


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
    if CPU_TORCH_DTYPES.get(dtype_key) is torch.float32:  # the yardstick (TF32 is fp32 on a CPU)
        return FormatSpeed(dtype_key, 1.0, 1.0, "fp32 itself")
    rates: dict[str, float | None] = {}
    for op in ("matmul", "conv") if conv else ("matmul",):
        if dtype_key not in CPU_DTYPES:  # fp8 / fp4: no CPU kernel to time
            rates[op] = None
            continue
        try:
            rates[op] = _ratio(dtype_key, info, op)
        except (RuntimeError, OSError, UsageError):
            rates[op] = None
    return FormatSpeed(
        dtype_key, rates.get("matmul"), rates.get("conv"), "measured on this CPU against fp32, cached"
    )


def _ratio(dtype_key: str, info: DeviceInfo, op: str) -> float | None:
    """The cached ratio of ``dtype_key``'s rate over fp32's for ``op``, measured on a miss."""
    path = default_cache_dir() / _CACHE
    key = cache_key(f"{dtype_key}|{op}|vs fp32, alternating", info)
    entries = _read_rates(path)
    if key not in entries:
        entries[key] = measure_format_ratio(dtype_key, op)
        with contextlib.suppress(UsageError):  # an unwritable cache costs a second a process, not the answer
            atomic_write_text(path, json.dumps({"version": _CACHE_VERSION, "entries": entries}, indent=2))
    return entries[key]


def _read_rates(path: Path) -> dict[str, float]:
    """The cache's valid entries; a missing, unreadable or foreign file reads as empty."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    entries = (
        data.get("entries") if isinstance(data, dict) and data.get("version") == _CACHE_VERSION else None
    )
    if not isinstance(entries, dict):
        return {}
    return {
        k: float(v)
        for k, v in entries.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and v > 0
    }


def _probe(op: str, dtype: torch.dtype) -> Callable[[], object]:
    """One call of the probe op in ``dtype``: a 512 F.linear (what autocast's Linear runs) or a
    ResNet stage's 3x3 convolution (64 channels, 28 px, batch 8, channels_last)."""
    gen = torch.Generator().manual_seed(0)  # own generator: the global RNG stream is left alone
    if op == "matmul":
        a, b = (torch.randn(512, 512, generator=gen).to(dtype) for _ in range(2))
        return lambda: torch.nn.functional.linear(a, b)
    x = torch.randn(8, 64, 28, 28, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(64, 64, 3, 3, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    return lambda: torch.nn.functional.conv2d(x, w, padding=1)


def _best_s(call: Callable[[], object], calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_format_ratio(
    dtype_key: str,
    op: str,
    *,
    rounds: int = ROUNDS,
    probe: Callable[[str, torch.dtype], Callable[[], object]] | None = None,
) -> float:
    """``dtype_key``'s rate over fp32's for ``op`` ("matmul" or "conv") on this CPU: ``rounds``
    alternating rounds (fp32's best call, then the format's), the median of the rounds' ratios.
    Strict fp32 oneDNN math, so an outer bf32 setting cannot inflate fp32's side."""
    from mixprec.state import PrecisionSettings, precision_settings

    if dtype_key not in CPU_DTYPES or op not in ("matmul", "conv"):
        raise UsageError(
            f"No CPU probe for {dtype_key!r} {op!r}; valid: dtypes {', '.join(CPU_DTYPES)}, ops matmul, conv."
        )
    with precision_settings(PrecisionSettings(mkldnn="ieee")), torch.no_grad():
        probe = probe or _probe
        base, own = probe(op, torch.float32), probe(op, CPU_TORCH_DTYPES[dtype_key])
        base()
        start = time.perf_counter()
        own()  # warm-up: oneDNN primitive creation, page faults
        calls = 1 if time.perf_counter() - start > _SLOW_CALL_S else _CALLS
        ratios = [_best_s(base, calls) / _best_s(own, calls) for _ in range(rounds)]
    return statistics.median(ratios)


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
