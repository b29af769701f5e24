"""`mixprec bench` quiet, then with CPU-bound neighbours beside it: the same figures, or a warning.

Runs `mixprec bench --model resnet50 --policies fp32,bf16-mixed` (the arguments after ``--`` replace
those) once on the quiet machine and once while ``--neighbours`` busy loops run beside it for the
whole run (issue 42: on a shared 2-core Xeon one busy neighbour made the default 2 threads 38-44x
slower). Prints each candidate's samples/s and paired speedup in both runs, their ratio, the threads
each run chose and its contention note, and writes them as JSON.

    python benchmarks/busy_bench.py [--neighbours 1] [--json out.json] [-- --model resnet50 ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT = ["--model", "resnet50", "--policies", "fp32,bf16-mixed"]


def _busy() -> None:
    while True:
        pass


def _bench(argv: list[str], neighbours: int) -> dict:
    """One `mixprec bench` run beside ``neighbours`` busy loops; what its JSON says."""
    loops = [mp.Process(target=_busy, daemon=True) for _ in range(neighbours)]
    for loop in loops:
        loop.start()
    try:
        time.sleep(1.0 if loops else 0.0)
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            started = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "mixprec", "bench", *argv, "--json", str(out)],
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - started
            load_after = os.getloadavg()[0]  # (the 1-minute average: the neighbours show by the end)
            if proc.returncode != 0 or not out.exists():
                raise SystemExit(f"mixprec bench exited {proc.returncode}: {proc.stderr[-2000:]}")
            result = json.loads(out.read_text())
    finally:
        for loop in loops:
            loop.kill()
    rows = {
        r["label"]: {
            "samples_per_s": r.get("throughput"),
            "speedup": r.get("speedup_vs_fp32"),
            "speedup_ci": r.get("speedup_ci"),
            "status": r.get("status"),
        }
        for r in result["rows"]
        if not r.get("baseline_repeat")
    }
    notes = [n for n in result.get("notes", []) if "threads" in n or "contention" in n]
    return {
        "neighbours": neighbours,
        "load_before": round(load, 2),
        "load_after": round(load_after, 2),
        "wall_s": round(wall, 1),
        "threads": result.get("settings", {}).get("threads"),
        "notes": notes,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--neighbours", type=int, default=1, help="busy loops beside the second run")
    parser.add_argument("--json", help="write both runs here")
    args, rest = parser.parse_known_args()
    if rest[:1] == ["--"]:  # (only the first: `bench -- python train.py` keeps its own)
        rest = rest[1:]
    argv = rest or DEFAULT
    quiet = _bench(argv, 0)
    busy = _bench(argv, args.neighbours)
    print(f"mixprec bench {' '.join(argv)}")
    for run in (quiet, busy):
        print(
            f"  {run['neighbours']} neighbours (load {run['load_before']} before, {run['load_after']} at the "
            f"end): threads {run['threads']}, "
            f"{run['wall_s']} s; {'; '.join(run['notes']) or 'no thread note'}"
        )
    for label, q in quiet["rows"].items():
        b = busy["rows"].get(label, {})
        print(f"  {label}: quiet {_figure(q)}, busy {_figure(b)}: busy/quiet {_ratio(q, b)}")
    if args.json:
        out = {"command": " ".join(["python", *sys.argv]), "machine": _machine(), "argv": argv}
        Path(args.json).write_text(json.dumps({**out, "quiet": quiet, "busy": busy}, indent=1) + "\n")


def _figure(row: dict) -> str:
    if row.get("status") != "ok" or not row.get("samples_per_s"):
        return f"{row.get('status', 'not measured')}"
    return f"{row['samples_per_s']:.1f} samples/s ({row.get('speedup') or 0:.2f}x)"


def _ratio(quiet: dict, busy: dict) -> str:
    q, b = quiet.get("samples_per_s"), busy.get("samples_per_s")
    return f"{b / q:.2f}" if q and b else "-"


def _machine() -> str:
    """The CPU's name and core count (the figures are this machine's only)."""
    from mixprec.hardware.device import detect

    return f"{os.cpu_count()}-core {detect('cpu').name}"


if __name__ == "__main__":
    main()
