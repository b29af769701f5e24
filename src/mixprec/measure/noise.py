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

# Other processes busy on this many CPUs on average while a sweep measures: the machine is
# contended (one busy process beside a CPU sweep halved strict fp32's samples/s on the 2-core EPYC,
# and the 2-vs-1-thread probe, 687 vs 578 ms, did not see it: issue 53).
CONTENDED_CPUS = 0.5
# ... and at least this share of the machine's CPUs (a many-core host always has some work on it).
CONTENDED_SHARE = 0.25
# ... or the hypervisor took this share of the CPU time for other guests.
CONTENDED_STEAL = 0.10


def _proc_stat() -> list[int] | None:
    """The aggregate 'cpu' line of /proc/stat: user nice system idle iowait irq softirq steal ..."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            first = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in first[1:]] if first and first[0] == "cpu" else None


def _process_cpu() -> dict[int, tuple[int, int, str, float]]:
    """Every process's (parent pid, start time, name, CPU seconds used), from /proc; {} elsewhere."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    found: dict[int, tuple[int, int, str, float]] = {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:  # it ended meanwhile
            continue
        name, rest = text[text.find("(") + 1 : text.rfind(")")], text[text.rfind(")") + 2 :].split()
        # after the name: state ppid ... utime (12th) stime (13th) ... starttime (20th)
        found[pid] = (int(rest[1]), int(rest[19]), name, (int(rest[11]) + int(rest[12])) / tick)
    return found


def _others(processes: dict[int, tuple[int, int, str, float]]) -> dict[int, tuple[int, str, float]]:
    """The processes outside this one's tree (mixprec, its candidates and compile workers):
    pid -> (start time, name, CPU seconds)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in processes.items():
        children.setdefault(ppid, []).append(pid)
    own, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        own.add(pid)
        todo += children.get(pid, [])
    return {pid: (start, name, cpu) for pid, (_, start, name, cpu) in processes.items() if pid not in own}


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
    return {
        "time": time.time(),
        "load": _loadavg(),
        "stat": _proc_stat(),
        "gpu": _gpu(device),
        "others": _others(_process_cpu()),
    }


def summarize(start: dict[str, Any], end: dict[str, Any], baseline_ms: tuple[float, ...]) -> dict[str, Any]:
    """The noise block of a bench result.

    Keys: cpus; load_start / load_end (1-minute load average); steal (share of CPU time the
    hypervisor gave to other guests during the sweep); iowait; gpu_start / gpu_end (NVML);
    baseline_spread (IQR over median of the strict-fp32 step times); baseline_steps; others_cpus
    and busiest_other (:func:`others_load`); contended (:func:`contention`: why, or None).
    """
    noise: dict[str, Any] = {"cpus": os.cpu_count(), "load_start": start["load"], "load_end": end["load"]}
    if start["stat"] and end["stat"]:
        delta = [b - a for a, b in zip(start["stat"], end["stat"], strict=False)]
        total = sum(delta) or 1
        noise["steal"] = delta[7] / total if len(delta) > 7 else None
        noise["iowait"] = delta[4] / total if len(delta) > 4 else None
    noise["gpu_start"], noise["gpu_end"] = start["gpu"], end["gpu"]
    noise.update(others_load(start.get("others") or {}, end.get("others") or {}, end["time"] - start["time"]))
    if len(baseline_ms) >= 3:
        q = statistics.quantiles(baseline_ms, n=4)
        noise["baseline_spread"] = (q[2] - q[0]) / statistics.median(baseline_ms)
    noise["baseline_steps"] = len(baseline_ms)
    noise["contended"] = contention(noise)
    return noise


def others_load(
    start: dict[int, tuple[int, str, float]], end: dict[int, tuple[int, str, float]], wall_s: float
) -> dict[str, Any]:
    """How many CPUs the processes outside mixprec's own tree kept busy between two snapshots
    (``others_cpus``), and the busiest of them (``busiest_other``: name, CPUs)."""
    if not end or wall_s <= 0:
        return {}
    used: dict[int, tuple[str, float]] = {}
    for pid, (started, name, cpu) in end.items():
        before = start.get(pid)
        # a pid that started after the first snapshot (or was reused) counts all its time
        used[pid] = (name, cpu - (before[2] if before and before[0] == started else 0.0))
    name, top = max(used.values(), key=lambda u: u[1], default=("", 0.0))
    return {
        "others_cpus": round(sum(cpu for _, cpu in used.values()) / wall_s, 3),
        "busiest_other": {"name": name, "cpus": round(top / wall_s, 3)} if top > 0 else None,
    }


def contention(noise: dict[str, Any]) -> str | None:
    """Why the machine was contended while the sweep measured (other processes kept at least
    ``CONTENDED_CPUS`` busy, or the hypervisor stole ``CONTENDED_STEAL`` of the time), or None:
    which figures that moves and which it does not."""
    others, steal, cpus = noise.get("others_cpus"), noise.get("steal") or 0.0, noise.get("cpus")
    if others is not None and others >= max(CONTENDED_CPUS, CONTENDED_SHARE * (cpus or 1)):
        busiest = noise.get("busiest_other") or {}
        top = f" ({busiest['name']!r} alone {busiest['cpus']:.1f})" if busiest.get("name") else ""
        seen = f"other processes kept {others:.1f} of the {cpus} CPUs busy while it measured{top}"
    elif steal >= CONTENDED_STEAL:
        seen = f"the hypervisor gave {steal:.0%} of the CPU time to other guests while it measured"
    else:
        return None
    return (
        f"contention: {seen}. Samples/s, step times and MFU are what the CPUs left free gave, not "
        "the quiet machine's; the speedups are paired step by step against strict fp32 in the same "
        "rounds, which contention moves far less. Measure on a quiet machine for figures to compare "
        "with others"
    )


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
    if noise.get("contended"):
        parts.append(noise["contended"])
    return "; ".join(parts)
