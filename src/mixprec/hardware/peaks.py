"""Peak FLOP/s per device and compute dtype, the denominator of MFU.

GPU peaks come from NVIDIA datasheets (dense figures: half of the "with sparsity" numbers the
datasheets print first). CPU peaks are measured once with a large matmul and cached on disk, because
no table could cover every CPU, core count and oneDNN build. Importing this module measures nothing
and does not initialise CUDA.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mixprec.errors import UsageError
from mixprec.files import atomic_write_text, read_json_cache
from mixprec.hardware.device import DeviceInfo

DTYPE_KEYS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")


@dataclass(frozen=True)
class PeakEntry:
    """Dense peak throughput of one GPU model for one compute dtype.

    ``device_pattern`` is a case-insensitive regular expression searched in the CUDA device name
    (``torch.cuda.get_device_properties().name``). The table is ordered most specific first and the
    first match wins; patterns also carry word boundaries so that e.g. ``L4`` never matches ``L40S``.
    """

    device_pattern: str
    dtype_key: str
    tflops: float
    source: str


def _entries(pattern: str, source: str, **tflops: float) -> list[PeakEntry]:
    return [PeakEntry(pattern, key, value, source) for key, value in tflops.items()]


_DENSE = "dense (half the with-sparsity figure)"

# Ordered: a more specific pattern must come before any more general one that also matches its names.
GPU_PEAKS: tuple[PeakEntry, ...] = tuple(
    [
        # --- Blackwell ---
        *_entries(
            r"\bB200\b",
            f"NVIDIA HGX B200 datasheet (2024), 8-GPU totals divided by 8, tensor figures {_DENSE}",
            fp32=75.0,
            tf32=1125.0,
            bf16=2250.0,
            fp16=2250.0,
            fp8=4500.0,
            fp4=9000.0,
        ),
        # --- Hopper --- (NVL parts first: they also match the generic H100/H200 names' prefixes)
        *_entries(
            r"\bH100\b.*\bNVL\b",
            f"NVIDIA H100 Tensor Core GPU datasheet (2024), H100 NVL column (per GPU), tensor {_DENSE}",
            fp32=60.0,
            tf32=417.5,
            bf16=835.5,
            fp16=835.5,
            fp8=1670.5,
        ),
        *_entries(
            r"\bH100\b.*\bPCIe\b",
            f"NVIDIA H100 Tensor Core GPU datasheet (2023), PCIe column, tensor {_DENSE}",
            fp32=51.0,
            tf32=378.0,
            bf16=756.0,
            fp16=756.0,
            fp8=1513.0,
        ),
        *_entries(
            r"\bH100\b.*\b(SXM|HBM3)",
            f"NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5 column, tensor {_DENSE}",
            fp32=67.0,
            tf32=494.7,
            bf16=989.4,
            fp16=989.4,
            fp8=1978.9,
        ),
        *_entries(
            r"\bGH200\b",
            f"NVIDIA GH200 Grace Hopper Superchip datasheet (2023), its H100 GPU, tensor {_DENSE}",
            fp32=67.0,
            tf32=494.7,
            bf16=989.4,
            fp16=989.4,
            fp8=1978.9,
        ),
        *_entries(
            r"\bH200\b.*\bNVL\b",
            f"NVIDIA H200 Tensor Core GPU datasheet (2024), H200 NVL column, tensor {_DENSE}",
            fp32=60.0,
            tf32=417.5,
            bf16=835.5,
            fp16=835.5,
            fp8=1670.5,
        ),
        *_entries(
            r"\bH200\b",  # \b keeps "GH200" out
            f"NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column, tensor {_DENSE}",
            fp32=67.0,
            tf32=494.7,
            bf16=989.4,
            fp16=989.4,
            fp8=1978.9,
        ),
        # --- Ada Lovelace ---
        *_entries(
            r"\bL40S\b",
            f"NVIDIA L40S GPU datasheet (2023), tensor {_DENSE}",
            fp32=91.6,
            tf32=183.0,
            bf16=362.0,
            fp16=362.0,
            fp8=733.0,
        ),
        *_entries(
            r"\bL40\b",
            f"NVIDIA L40 GPU datasheet (2022), tensor {_DENSE}",
            fp32=90.5,
            tf32=90.5,
            bf16=181.0,
            fp16=181.0,
            fp8=362.0,
        ),
        *_entries(
            r"\bL4\b",
            f"NVIDIA L4 Tensor Core GPU datasheet (2023), tensor {_DENSE}",
            fp32=30.3,
            tf32=60.0,
            bf16=121.0,
            fp16=121.0,
            fp8=242.5,
        ),
        *_entries(
            r"RTX 4090\s*$",  # anchored: "RTX 4090 D" and the laptop part are different chips
            "NVIDIA Ada GPU architecture whitepaper (2022), GeForce RTX 4090, "
            "tensor with FP32 accumulate (what PyTorch uses), dense",
            fp32=82.6,
            tf32=82.6,
            bf16=165.2,
            fp16=165.2,
        ),
        # --- Ampere ---
        *_entries(
            r"\bA100\b.*\bSXM",
            f"NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column (40GB and 80GB), tensor {_DENSE}",
            fp32=19.5,
            tf32=156.0,
            bf16=312.0,
            fp16=312.0,
        ),
        *_entries(
            r"\bA100\b.*\bPCIe\b",
            f"NVIDIA A100 Tensor Core GPU datasheet (2021), PCIe column (40GB and 80GB), tensor {_DENSE}",
            fp32=19.5,
            tf32=156.0,
            bf16=312.0,
            fp16=312.0,
        ),
        *_entries(
            r"\bA10G\b",
            "NVIDIA A10G (AWS EC2 G5) figures as published by AWS partners; no public NVIDIA datasheet, "
            "dense",
            fp32=31.52,
            tf32=35.0,
            bf16=70.0,
            fp16=70.0,
        ),
        *_entries(
            r"\bA10\b",
            f"NVIDIA A10 Tensor Core GPU datasheet (2021), tensor {_DENSE}",
            fp32=31.2,
            tf32=62.5,
            bf16=125.0,
            fp16=125.0,
        ),
        *_entries(
            r"RTX 3090\s*$",  # anchored: the RTX 3090 Ti is faster
            "NVIDIA Ampere GA102 GPU architecture whitepaper (2020), GeForce RTX 3090, "
            "tensor with FP32 accumulate (what PyTorch uses), dense",
            fp32=35.6,
            tf32=35.6,
            bf16=71.0,
            fp16=71.0,
        ),
        # --- Turing / Volta --- (no TF32, no bf16 tensor cores)
        *_entries(
            r"\bT4\b",
            "NVIDIA T4 Tensor Core GPU datasheet (2019), FP16 is mixed precision (FP16/FP32), dense",
            fp32=8.1,
            fp16=65.0,
        ),
        *_entries(
            r"\bV100S\b",
            "NVIDIA V100S Tensor Core GPU datasheet (2019), PCIe, tensor performance, dense",
            fp32=16.4,
            fp16=130.0,
        ),
        *_entries(
            r"\bV100\b.*\bSXM",
            "NVIDIA V100 Tensor Core GPU datasheet (2020), SXM2 column, tensor performance, dense",
            fp32=15.7,
            fp16=125.0,
        ),
        *_entries(
            r"\bV100\b.*\bPCIe\b",
            "NVIDIA V100 Tensor Core GPU datasheet (2020), PCIe column, tensor performance, dense",
            fp32=14.0,
            fp16=112.0,
        ),
    ]
)


def _check_dtype_key(dtype_key: str) -> None:
    if dtype_key not in DTYPE_KEYS:
        raise UsageError(f"Unknown compute dtype key {dtype_key!r}; valid: {', '.join(DTYPE_KEYS)}.")


def find_gpu_entry(name: str, dtype_key: str) -> PeakEntry | None:
    """The table entry for a CUDA device name and dtype key: the first (most specific) model that matches.

    The model is chosen before the dtype: a GPU without that dtype gives ``None`` rather than falling
    through to a less specific model that has it.
    """
    _check_dtype_key(dtype_key)
    for entry in GPU_PEAKS:
        if re.search(entry.device_pattern, name, flags=re.IGNORECASE):
            model = entry.device_pattern
            for candidate in GPU_PEAKS:
                if candidate.device_pattern == model and candidate.dtype_key == dtype_key:
                    return candidate
            return None
    return None


def gpu_peak(name: str, dtype_key: str) -> tuple[float, str] | None:
    """(dense peak FLOP/s, citation) for a CUDA device name and dtype key, or ``None`` when unknown."""
    entry = find_gpu_entry(name, dtype_key)
    if entry is None:
        return None
    return entry.tflops * 1e12, entry.source


# --------------------------------------------------------------------------- CPU: measured

CPU_TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "tf32": torch.float32,  # TF32 does not exist on CPU: the fp32 peak applies
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
CPU_DTYPES: tuple[str, ...] = tuple(CPU_TORCH_DTYPES)  # the dtype keys a CPU probe can time
_MAX_ONE_S = 0.5  # a size whose single matmul would take longer is halved
_BUDGET_S = 0.8  # cap on the timed blocks of one measurement (warm-up and probe come on top)
_PROBE_SIZE = 512
_MIN_SIZE = 64
# Size actually used by the last measurement per dtype key (fp16 without hardware support is measured
# at a smaller size), for the source text.
_LAST_SIZE: dict[str, int] = {}


# F.linear, not torch.mm: it is the op autocast's Linear layers run, and on CPUs without native
# fp16 its oneDNN path is ~6x faster than mm's, so mm would understate the fp16 peak (MFU > 100%).
_PEAK_STMT = "torch.nn.functional.linear(a, b)"


def _once(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.nn.functional.linear(a, b)
    return time.perf_counter() - start


def _operands(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)  # own generator: the global RNG stream is left alone
    return (
        torch.randn(n, n, generator=gen).to(dtype),
        torch.randn(n, n, generator=gen).to(dtype),
    )


def measure_cpu_peak(dtype_key: str, *, size: int = 2048, repeats: int = 5) -> float:
    """Achieved FLOP/s of a square ``size`` matmul in ``dtype_key`` on this CPU: best of about
    ``repeats`` timed blocks (fewer when they would exceed about 0.8 s together).

    A 512 probe predicts the cost first and the size is halved while one matmul would take over 0.5 s,
    so dtypes the CPU only emulates (fp16 without AVX512-FP16/AMX) are measured at a smaller size
    instead of taking minutes. Runs with strict fp32 oneDNN math so an outer bf32 setting cannot
    inflate the fp32 figure. The whole measurement stays under about 2 s.
    """
    from torch.utils.benchmark import Timer

    from mixprec.state import PrecisionSettings, precision_settings

    _check_dtype_key(dtype_key)
    if dtype_key not in CPU_TORCH_DTYPES:
        raise UsageError(f"No CPU matmul for dtype key {dtype_key!r}; valid: {', '.join(CPU_TORCH_DTYPES)}.")
    if size < 1 or repeats < 1:
        raise UsageError(f"size and repeats must be positive, got size={size}, repeats={repeats}.")
    dtype = CPU_TORCH_DTYPES[dtype_key]
    with precision_settings(PrecisionSettings(mkldnn="ieee")), torch.no_grad():
        # Probe at a moderate size (halved while even that is too slow), then extrapolate with the
        # cube law so a slow dtype never starts at the full size.
        m = min(int(size), _PROBE_SIZE)
        while True:
            a, b = _operands(m, dtype)
            t_one = _once(a, b)  # warm-up: oneDNN primitive creation, page faults
            if t_one <= 2 * _MAX_ONE_S:
                t_one = min(_once(a, b) for _ in range(3 if t_one < 0.05 else 1))
            if t_one <= 2 * _MAX_ONE_S or m <= _MIN_SIZE:
                break
            m = max(m // 2, _MIN_SIZE)
        t_one = max(t_one, 1e-9)
        n = int(size)
        while n > m and t_one * (n / m) ** 3 > _MAX_ONE_S:
            n //= 2
        if n > m:
            a, b = _operands(n, dtype)
            t_one = max(_once(a, b), 1e-9)  # warm-up at the final size
        else:
            n = m
        timer = Timer(
            stmt=_PEAK_STMT,
            globals={"torch": torch, "a": a, "b": b},
            num_threads=torch.get_num_threads(),
        )
        # Blocks of calls until min_run_time is spent; the best block is the peak.
        measurement = timer.blocked_autorange(min_run_time=min(max(int(repeats) * t_one, 0.02), _BUDGET_S))
        rate = 2.0 * n**3 / min(measurement.times)
        if m < n:
            # the probe size too: caches make a smaller matmul the faster one on some CPUs
            a, b = _operands(m, dtype)
            small = Timer(
                stmt=_PEAK_STMT, globals={"torch": torch, "a": a, "b": b}, num_threads=torch.get_num_threads()
            )
            probe_rate = 2.0 * m**3 / min(small.blocked_autorange(min_run_time=0.1).times)
            if probe_rate > rate:
                rate, n = probe_rate, m
    _LAST_SIZE[dtype_key] = n
    return rate


def default_cache_dir() -> Path:
    return Path(os.environ.get("MIXPREC_CACHE_DIR", "~/.cache/mixprec")).expanduser()


def cache_key(measure_key: str, info: DeviceInfo) -> str:
    flags = ",".join(sorted(info.cpu_flags))
    return (
        f"{info.name}|{flags}|threads={torch.get_num_threads()}|torch={torch.__version__}|{measure_key}"
        f"|op={_PEAK_STMT}"  # a new measuring op invalidates old entries
    )


_CACHE_VERSION = 1


def _read_cache(path: Path) -> dict[str, dict[str, object]]:
    """Valid entries of the cache file; a missing one reads as empty, an unreadable or corrupt
    one (or one of another version) as empty with a one-line :class:`CacheWarning`."""
    entries = read_json_cache(path, "CPU peak cache", _CACHE_VERSION, "entries", then="measuring again")
    good: dict[str, dict[str, object]] = {}
    for key, entry in entries.items():
        if not isinstance(entry, dict):
            continue
        flops, source = entry.get("flops"), entry.get("source")
        if (
            isinstance(flops, int | float)
            and not isinstance(flops, bool)
            and math.isfinite(flops)
            and flops > 0
            and isinstance(source, str)
        ):
            good[key] = {"flops": float(flops), "source": source}
    return good


def _write_cache(path: Path, entries: dict[str, dict[str, object]]) -> None:
    """Atomically replace the cache file (:func:`mixprec.files.atomic_write_text`)."""
    text = json.dumps({"version": _CACHE_VERSION, "entries": entries}, indent=2, sort_keys=True)
    atomic_write_text(path, text, "CPU peak cache")


def cpu_peak(
    dtype_key: str,
    info: DeviceInfo,
    *,
    cache_dir: Path | None = None,
    refresh: bool = False,
) -> tuple[float, str]:
    """(measured peak FLOP/s, source) for this CPU, measured once and then read from the cache.

    The cache is ``cpu_peaks.json`` in ``cache_dir``, else ``$MIXPREC_CACHE_DIR``, else
    ``~/.cache/mixprec``, keyed by CPU name, flags, torch thread count, torch version and dtype.
    ``refresh`` measures again and keeps the larger figure: a peak taken while the machine was
    busy understates what the CPU can do, and a run that beats it proves so.
    """
    _check_dtype_key(dtype_key)
    measure_key = "fp32" if dtype_key == "tf32" else dtype_key  # TF32 does not exist on CPU
    path = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "cpu_peaks.json"
    key = cache_key(measure_key, info)
    entries = _read_cache(path)
    if key in entries and not refresh:
        return float(entries[key]["flops"]), str(entries[key]["source"])  # type: ignore[arg-type]

    _LAST_SIZE.pop(measure_key, None)
    flops = float(measure_cpu_peak(measure_key))
    if key in entries and float(entries[key]["flops"]) >= flops:  # type: ignore[arg-type]
        return float(entries[key]["flops"]), str(entries[key]["source"])  # type: ignore[arg-type]
    size = _LAST_SIZE.get(measure_key, 2048)
    threads = torch.get_num_threads()
    plural = "s" if threads != 1 else ""
    source = (
        f"measured: {size}^3 {measure_key} matmul on this CPU, {threads} thread{plural}, cached in {path}"
    )
    entries[key] = {"flops": flops, "source": source}
    try:
        _write_cache(path, entries)
    except UsageError as exc:
        source = source.replace(f"cached in {path}", f"not cached ({exc})")
    return flops, source


def peak_flops(
    info: DeviceInfo, dtype_key: str, *, cache_dir: Path | None = None
) -> tuple[float | None, str]:
    """(peak FLOP/s or None, source) for compute in ``dtype_key`` (a policy spec's ``peak_key``) on ``info``.

    CUDA: the datasheet table; CPU: a cached measurement. Never raises for a known dtype key.
    """
    _check_dtype_key(dtype_key)
    if info.type == "cuda":
        found = gpu_peak(info.name, dtype_key)
        if found is None:
            return None, f"no datasheet entry for {info.name} {dtype_key}"
        return found
    if info.type == "cpu":
        if dtype_key not in CPU_TORCH_DTYPES:
            return None, f"no CPU {dtype_key} matmul to measure"
        try:
            return cpu_peak(dtype_key, info, cache_dir=cache_dir)
        except (RuntimeError, OSError, UsageError) as exc:
            return None, f"CPU {dtype_key} peak could not be measured: {exc}"
    return None, f"no peak FLOP/s for device type {info.type!r}"
