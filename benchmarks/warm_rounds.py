"""Is a paired round's lone step, the first after the other session ran, slower than a step of a
loop? (issue 53: tune's and bench's figure for a pick read below the plain probe's in 6 of 6 and 4
of 6 runs on the 2-core EPYC.)

A model whose step takes longer than the round's ``ROUND_S`` runs one step per side per round, so
every step timed is the first after a switch between the two processes (caches, TLB and the
allocator's pages refilled from the other's). The probe, like a training loop, times steps that
follow steps of their own. A cost ``d`` paid on each side's first step pulls the ratio toward 1:
(f + d) / (c + d) < f / c.

This runs ``mixprec.bench`` of one pair (strict fp32 and ``--policy``, ``--channels-last``) in
fresh processes, each way in turn: ``lone`` (mixprec's rounds: one step per side) and ``warm``
(three steps per side, the first left out, as the module documents for rounds of three or more),
``--repeats`` times each, interleaved, then the plain probe in one process (bench_vs_tune.py's, the
same as its third figure).

    python benchmarks/warm_rounds.py --model resnet50 --policy bf16-mixed --channels-last [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_vs_tune import PROBE
from mixprec.policy import Candidate

SIZES = {"resnet50": ("resnet50", {"image_size": 128}, 16)}

BENCH = """
import json, sys
import mixprec
from mixprec.measure import paired
from mixprec.policy import Candidate
spec = json.loads(sys.argv[1])
if spec["way"] == "warm":  # three steps a side, the first left out (paired._settled)
    lone = paired._round_steps
    paired._round_steps = lambda step_s: max(3, lone(step_s))
workload = mixprec.load_workload(spec["model"], **spec["sizes"])
pick = Candidate(spec["policy"], channels_last=spec["channels_last"])
result = mixprec.bench(
    workload, candidates=(pick,), batch_size=spec["batch_size"], threads=spec["threads"],
    steps=spec["rounds"], settle=0,
)
open(spec["out"], "w").write(json.dumps(result.to_dict()))
"""


def _python(code: str, spec: dict) -> dict:
    subprocess.run([sys.executable, "-c", code, json.dumps(spec)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(spec["out"]).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(SIZES), default="resnet50")
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json")
    args = parser.parse_args()
    model, sizes, batch = SIZES[args.model]
    pair = {"policy": args.policy, "channels_last": args.channels_last}
    pick = Candidate(args.policy, channels_last=args.channels_last)
    label = pick.label
    runs: dict[str, list[dict]] = {"lone": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for way in runs:
                spec = {
                    "way": way, "model": model, "sizes": sizes, **pair, "batch_size": batch,
                    "threads": args.threads, "rounds": args.rounds, "out": f"{tmp}/{way}-{i}.json",
                }  # fmt: skip
                load = os.getloadavg()[0]
                row = next(r for r in _python(BENCH, spec)["rows"] if r["label"] == label)
                runs[way].append(
                    {"speedup": row["speedup_vs_fp32"], "ratios": row["paired_ratios"], "load": load}
                )
                print(f"{way} {i + 1}: {row['speedup_vs_fp32']:.3f}x (load {load:.1f})", flush=True)
        spec = {"model": args.model, "candidate": pick.to_dict(), "threads": args.threads,
                "rounds": args.rounds, "out": f"{tmp}/probe.json"}  # fmt: skip
        probe = _python(PROBE, spec)
    probe_x = probe["pick"]["speedup_vs_fp32_eager"]
    summary = {way: statistics.median(r["speedup"] for r in rs) for way, rs in runs.items()}
    print(f"{label} median: lone {summary['lone']:.3f}x, warm {summary['warm']:.3f}x, probe {probe_x:.3f}x")
    if args.json:
        out = {"argv": sys.argv, "runs": runs, "median": summary, "probe": probe}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
