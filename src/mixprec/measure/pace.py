"""This machine's quiet pace, kept across runs: a strict-fp32 step far slower than the fastest this
machine gave the same workload before is contention no process list shows.

The other rules (:func:`mixprec.measure.noise.contention`, the thread probe's) see processes
beside mixprec and the steal time a hypervisor reports. On the 2-core AMX Xeon VM neither saw why
one `bench_vs_tune` run's strict-fp32 step took 1.40 s where the run before took 0.81 s (the
hypervisor reports no steal; no process in the guest took CPU time the other rule counts), and every
samples/s it printed read ~40% low without a word. The fastest strict-fp32 step per workload (its
name, batch, FLOPs per step, threads, device, torch) is kept in mixprec's cache directory
(``baseline_steps.json``); a sweep whose step is :data:`SLOWER` times that says so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mixprec.files import read_json_cache, write_json_cache
from mixprec.hardware.peaks import default_cache_dir
from mixprec.measure.compile_cache import cost_key

# A strict-fp32 step this many times the fastest kept for it: the machine is not what it was.
# (Run to run on a quiet machine the median step moves ~10-15% on the AMX Xeon VM.)
SLOWER = 1.4
_VERSION = 1


def pace_key(
    framework: str, workload: str, batch_size: int, flops: float | None, device: str, threads: Any
) -> str:
    """What strict fp32's step time depends on: what a compile's cost does (:func:`cost_key`), with
    the FLOPs per step where counted (a changed model under the same name is a new workload) and
    ``device`` naming the machine too (a home directory may be shared by unlike machines)."""
    return cost_key(framework, workload, batch_size, f"strict fp32, {flops or 0:.4g} FLOPs", device, threads)


class Paces:
    """The fastest strict-fp32 median step seen per :func:`pace_key` on this machine. A bad file
    reads as empty with one warning; one that cannot be written is a warning (a saving, not a
    result)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_cache_dir() / "baseline_steps.json"
        entries = read_json_cache(self.path, "baseline step record", _VERSION, "entries")
        self.entries = {k: e for k, e in entries.items() if isinstance(e, dict) and _seconds(e.get("step_s"))}

    def slower(self, key: str, step_s: float) -> str | None:
        """Why a strict-fp32 median step of ``step_s`` says the machine is slower than it was (it is
        :data:`SLOWER` times the fastest kept), or None."""
        best = self.entries.get(key)
        if best is None or step_s < SLOWER * best["step_s"]:
            return None
        return (
            f"contention: strict fp32's step took {step_s * 1e3:.0f} ms, {step_s / best['step_s']:.1f}x "
            f"the fastest this machine gave this workload before ({best['step_s'] * 1e3:.0f} ms on "
            f"{best['date']}), with no other process seen: the host is shared (another guest) or the "
            "workload changed. Samples/s, step times and MFU read low; the speedups are paired step "
            "by step against strict fp32 in the same rounds, which a slower machine moves far less"
        )

    def record(self, key: str, step_s: float) -> None:
        """Keep ``step_s`` where it is the fastest seen for ``key``."""
        if not _seconds(step_s) or (key in self.entries and self.entries[key]["step_s"] <= step_s):
            return
        self.entries[key] = {"step_s": float(step_s), "date": time.strftime("%Y-%m-%d")}
        write_json_cache(self.path, "baseline step record", _VERSION, "entries", self.entries)


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e6
