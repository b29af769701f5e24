"""How busy the machine was while a sweep measured: load, steal time, GPU clocks, baseline spread.

A speedup is only as good as the quiet it was measured in. The sweep snapshots the machine
before and after, and the strict-fp32 baseline, timed throughout, shows how much the same work
varied: when that spread is larger than the gaps that decide the pick, the decision says so.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any


def _proc_stat() -> list[int] | None:
    """The aggregate 'cpu' line of /proc/stat: user nice system idle iowait irq softirq steal ..."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            first = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in first[1:]] if first and first[0] == "cpu" else None


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _gpu(device: str) -> dict[str, Any] | None:
    """SM clock against its maximum and other processes on the GPU, via NVML when installed."""
    if not device.startswith("cuda"):
        return None
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        index = int(device.split(":")[1]) if ":" in device else 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        clock = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        max_clock = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        others = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        return {"sm_clock_mhz": clock, "sm_clock_max_mhz": max_clock, "compute_processes": others}
    except Exception:  # NVML missing or refused (containers): no GPU figures, not a failure
        return None


def snapshot(device: str) -> dict[str, Any]:
    """What the machine is doing now; :func:`summarize` compares two of them."""
    return {"time": time.time(), "load": _loadavg(), "stat": _proc_stat(), "gpu": _gpu(device)}


def summarize(start: dict[str, Any], end: dict[str, Any], baseline_ms: tuple[float, ...]) -> dict[str, Any]:
    """The noise block of a bench result.

    Keys: cpus; load_start / load_end (1-minute load average); steal (share of CPU time the
    hypervisor gave to other guests during the sweep); iowait; gpu_start / gpu_end (NVML);
    baseline_spread (IQR over median of the strict-fp32 step times); baseline_steps.
    """
    noise: dict[str, Any] = {"cpus": os.cpu_count(), "load_start": start["load"], "load_end": end["load"]}
    if start["stat"] and end["stat"]:
        delta = [b - a for a, b in zip(start["stat"], end["stat"], strict=False)]
        total = sum(delta) or 1
        noise["steal"] = delta[7] / total if len(delta) > 7 else None
        noise["iowait"] = delta[4] / total if len(delta) > 4 else None
    noise["gpu_start"], noise["gpu_end"] = start["gpu"], end["gpu"]
    if len(baseline_ms) >= 3:
        q = statistics.quantiles(baseline_ms, n=4)
        noise["baseline_spread"] = (q[2] - q[0]) / statistics.median(baseline_ms)
    noise["baseline_steps"] = len(baseline_ms)
    return noise


def describe(noise: dict[str, Any]) -> str:
    """One line for the console: what the noise block says, in words."""
    parts = []
    spread = noise.get("baseline_spread")
    if spread is not None:
        parts.append(
            f"strict fp32 step time varied {spread:.0%} (IQR/median over {noise.get('baseline_steps')} steps)"
        )
    load, cpus = noise.get("load_end"), noise.get("cpus")
    if load is not None and cpus:
        parts.append(f"load average {load:.1f} on {cpus} CPUs")
    steal = noise.get("steal")
    if steal:
        parts.append(f"{steal:.0%} of CPU time stolen by other guests")
    gpu = noise.get("gpu_end") or {}
    if gpu.get("compute_processes", 0) > 1:
        parts.append(f"{gpu['compute_processes']} processes on the GPU")
    return "; ".join(parts)
