"""Does bench's own session length move its figure? (issue 53: in bench_vs_tune runs 14-19 on the
2-core EPYC, bench's figure for tune's pick was 0.90-1.01 of plain PyTorch's a variant per loop,
below it in four of six, while tune's was 0.86-1.08; bench's strict-fp32 steps ran ~5% faster than
tune's and its candidate's ~5% slower in runs 18 and 19.)

Tune measures over sessions of 4 paired rounds after 1 warm-up step; bench by default over 10 after
2. This runs ``mixprec.bench`` of one pair (strict fp32 and bf16-mixed+cl) in fresh processes, each
way in turn, ``--repeats`` times each, interleaved (``tune``: 4 rounds, 1 warm-up; ``bench``: 10
rounds, 2 warm-ups), unsettled, and prints each way's figures and step times.

    python benchmarks/bench_steps.py [--repeats 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from warm_rounds import _python

WAYS = {"tune": {"steps": 4, "warmup": 1}, "bench": {"steps": 10, "warmup": 2}}

BENCH = """
import json, sys
import mixprec
from mixprec.policy import Candidate
spec = json.loads(sys.argv[1])
workload = mixprec.load_workload("resnet50", image_size=128)
pick = Candidate("bf16-mixed", channels_last=True)
result = mixprec.bench(
    workload, candidates=(pick,), batch_size=16, threads=2, steps=spec["steps"],
    warmup=spec["warmup"], settle=0,
)
open(spec["out"], "w").write(json.dumps(result.to_dict()))
"""


def _figures(result: dict) -> dict:
    rows = {r["label"]: r for r in result["rows"] if not r.get("baseline_repeat")}
    pick, fp32 = rows["bf16-mixed+cl"], rows["fp32"]
    return {
        "speedup": pick["speedup_vs_fp32"],
        "fp32_ms": statistics.median(fp32["step_times_ms"]),
        "pick_ms": statistics.median(pick["step_times_ms"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for way in WAYS if i % 2 == 0 else reversed(WAYS):
                spec = {**WAYS[way], "out": str(Path(tmp) / f"{way}-{i}.json")}
                runs[way].append(_figures(_python(BENCH, spec)))
                print(way, {k: round(v, 3) for k, v in runs[way][-1].items()}, flush=True)
    summary = {
        way: {key: statistics.median(r[key] for r in rs) for key in ("speedup", "fp32_ms", "pick_ms")}
        for way, rs in runs.items()
    }
    for way, s in summary.items():
        steps = f"fp32 {s['fp32_ms']:.0f} ms, pick {s['pick_ms']:.0f} ms"
        print(f"{way:>5} ({WAYS[way]}): median {s['speedup']:.2f}x, {steps}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
