"""How often a 2-rank gloo job aborts at exit after its last collective, with and without
``mixprec.process.let_gloo_workers_finish`` at exit.

Each run is ``torchrun --standalone --nproc_per_node 2`` of a tiny script: 200 ``all_reduce`` calls
on tensors made in Python, the last one just before the script ends. In torch 2.14.1, gloo's worker
thread can let go of that last collective's work (and the tensor's Python object with it) after the
interpreter began to shut down; the rank then aborts (SIGABRT, "terminate called without an active
exception", pytorch#190489), although every step ran. Busy loops beside the runs make the worker
lag, as CI's parallel test workers do. Variants: ``plain`` (the script as written), ``wait`` (the
script registers ``let_gloo_workers_finish`` with ``atexit``, as ``mixprec run`` does at the end of
a run).

    python benchmarks/gloo_exit.py [--runs 16] [--busy 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SCRIPT = """
import atexit, sys
import torch, torch.distributed as dist
if sys.argv[1] == "wait":
    from mixprec.process import let_gloo_workers_finish
    atexit.register(let_gloo_workers_finish)
dist.init_process_group("gloo")
for i in range(200):
    dist.all_reduce(torch.full((64,), float(i)))
dist.all_reduce(torch.ones(3))
"""


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ABORT = "terminate called without an active exception"


def _busy() -> None:
    while True:
        pass


def _run(script: Path, variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [*TORCHRUN, str(script), variant],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    return {"rc": done.returncode, "aborted_ranks": done.stderr.count(ABORT)}


def _machine() -> str:
    """The CPU's name and core count (the figures are this machine's only)."""
    from mixprec.hardware.device import detect

    return f"{os.cpu_count()}-core {detect('cpu').name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=16, help="runs per variant (interleaved)")
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the runs")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    loops = [mp.Process(target=_busy, daemon=True) for _ in range(args.busy)]
    for loop in loops:
        loop.start()
    runs: dict[str, list[dict]] = {"plain": [], "wait": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "job.py"
            script.write_text(SCRIPT)
            for i in range(args.runs):
                for variant in runs:  # interleaved: both see the same load
                    runs[variant].append(_run(script, variant))
                codes = ", ".join(f"{v} rc {r[-1]['rc']}" for v, r in runs.items())
                print(f"run {i + 1}/{args.runs}: {codes}", flush=True)
    finally:
        for loop in loops:
            loop.kill()
    summary = {
        variant: {
            "runs": len(r),
            "failed": sum(x["rc"] != 0 for x in r),
            "aborted_ranks": sum(x["aborted_ranks"] for x in r),
        }
        for variant, r in runs.items()
    }
    for variant, s in summary.items():
        aborted = f"{s['aborted_ranks']} ranks aborted at exit"
        print(f"{variant:>5}: {s['failed']} of {s['runs']} runs failed ({aborted})")
    if args.json:
        record = {
            "command": "python benchmarks/gloo_exit.py " + " ".join(sys.argv[1:]),
            "torch": torch.__version__,
            "machine": _machine(),
            "busy_loops": args.busy,
            "summary": summary,
            "runs": runs,
        }
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
