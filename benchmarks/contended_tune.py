"""`mixprec tune` on a busy machine: what it recommends while a neighbour steals the CPU.

Runs `mixprec tune --workload WORKLOAD` in a subprocess while, ``--burn-at`` seconds after the
start, ``--burners`` busy-loop processes run for ``--burn-s`` seconds (the neighbour). Prints the
pick, its claimed speedup and the console's noise lines, and writes them as JSON. Pass
``--mixprec-src`` to run another checkout's mixprec (e.g. a release before paired measurement)
under the very same load, for a before/after:

    git worktree add /tmp/mixprec-old c2f069e
    python benchmarks/contended_tune.py --mixprec-src /tmp/mixprec-old/src --json old.json
    python benchmarks/contended_tune.py --json new.json

The workload defaults to timm's convnext_atto (benchmarks/workloads/timm_convnext.py; needs timm).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_WORKLOAD = f"{HERE / 'workloads' / 'timm_convnext.py'}:workload"


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--budget", type=float, default=180.0)
    parser.add_argument("--burners", type=int, default=3)
    parser.add_argument("--burn-at", type=float, default=5.0, help="seconds after the start")
    parser.add_argument("--burn-s", type=float, default=12.0)
    parser.add_argument("--mixprec-src", help="the src/ directory of the mixprec to run (default: installed)")
    parser.add_argument("--extra", default="", help="more `mixprec tune` arguments, one string")
    parser.add_argument("--json", help="write the outcome here")
    args = parser.parse_args()

    env = dict(os.environ)
    if args.mixprec_src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.mixprec_src, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "mixprec",
        "tune",
        "--workload",
        args.workload,
        "--budget",
        str(args.budget),
        "--no-lint",
        *args.extra.split(),
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(args.burn_at)
    burners = [mp.Process(target=_burn, args=(args.burn_s,)) for _ in range(args.burners)]
    for b in burners:
        b.start()
    out, _ = proc.communicate()
    for b in burners:
        b.join()
    wall = time.perf_counter() - started
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    pick = re.search(r"recommended: (\S+)\s+([\d.]+)x strict fp32", plain)
    outcome = {
        "command": " ".join(cmd),
        "mixprec_src": args.mixprec_src or "installed",
        "load": f"{args.burners} busy loops for {args.burn_s} s from t={args.burn_at} s",
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "pick": pick.group(1) if pick else None,
        "claimed_speedup": float(pick.group(2)) if pick else None,
        "noise_lines": [ln for ln in plain.splitlines() if ln.startswith(("measured:", "note:"))],
        "console": plain,
    }
    print(plain)
    print(json.dumps({k: v for k, v in outcome.items() if k != "console"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(outcome, indent=2) + "\n")


if __name__ == "__main__":
    main()
