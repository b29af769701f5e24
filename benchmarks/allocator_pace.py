"""Does glibc's allocator set a fresh process's pace? (issue 53: the same bf16-mixed step ran at
621-792 ms from one fresh process to the next, benchmarks/step_alone.py; keeping glibc from trimming
and from its moving mmap threshold closed the one-process probe's gap, shared_process.py.)

The plain probe's hand-written step (benchmarks/probe_vs_tune.py, via step_alone.py's worker), strict
fp32 and one candidate, each alone in a fresh process, under glibc's defaults and under fixed
thresholds (``--tunables``), the four combinations in rotated order, ``--repeats`` processes each, in
one run: whether the settings move the step's time, and the spread between processes.

    python benchmarks/allocator_pace.py [--candidate bf16-mixed] [--repeats 6] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixprec.policy import Candidate
from step_alone import time_alone

FIXED = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--candidate", default="bf16-mixed", help="the candidate beside strict fp32")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tunables", default=FIXED, help="GLIBC_TUNABLES for the fixed setting")
    parser.add_argument("--json")
    args = parser.parse_args()

    pick = Candidate(args.candidate, channels_last=args.channels_last)
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    envs = {"default": base, "fixed": {**base, "GLIBC_TUNABLES": args.tunables}}
    combos = [(e, n, c) for e in envs for n, c in (("fp32", Candidate("fp32")), ("pick", pick))]
    runs: dict[str, list[float]] = {f"{e} {n}": [] for e, n, _ in combos}
    for rep in range(args.repeats):
        order = combos[rep % len(combos) :] + combos[: rep % len(combos)]
        for env, name, cand in order:
            ms = time_alone("plain", cand, args.steps, what=f"{env} {name}", env=envs[env])
            runs[f"{env} {name}"].append(ms)
            print(f"repeat {rep + 1}: {env:>7} {name}: {ms:.0f} ms", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    spread = {k: max(v) / min(v) - 1 for k, v in runs.items()}
    for k, v in runs.items():
        each = ", ".join(f"{x:.0f}" for x in v)
        print(f"{k:>12}: {med[k]:.0f} ms, processes {100 * spread[k]:.0f}% apart ({each})")
    for env in envs:
        print(f"{env:>7}: {pick.label} {med[f'{env} fp32'] / med[f'{env} pick']:.3f}x strict fp32")
    if args.json:
        out = {"argv": sys.argv, "pick": pick.label, "tunables": args.tunables, "ms": runs}
        out |= {"median_ms": med, "spread": spread}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
