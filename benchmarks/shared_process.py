"""Does a step run slower in a process that also holds (and runs) another variant's model? (issue 53:
the plain probe holds strict fp32 and the pick in one process and read the pick's speedup ~4%
above the same hand-written steps timed each in a process of its own, benchmarks/method_gap.py;
its strict-fp32 step took 1.2-1.3 s where mixprec's own processes took 1.0-1.2 s.)

In each of ``--processes`` fresh processes: strict fp32's step and the pick's (probe_vs_tune's
hand-written steps) timed ``--rounds`` rounds each *alone* (only that variant built and run so
far), then both built and timed in ``--rounds`` interleaved rounds as the probe times them. A step
that is slower beside the other variant than alone is what holding both in one process costs it.

    python benchmarks/shared_process.py --model resnet50 --policy bf16-mixed --channels-last [--json out.json]
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

WORKER = f"""
import json, statistics, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import torch
from probe_vs_tune import IEEE, MODELS, time_round, warmed_step
from mixprec import state
from mixprec.policy import Candidate
spec = json.loads(sys.argv[1])
model = MODELS[spec["model"]]
torch.manual_seed(0)
torch.set_num_threads(spec["threads"])
workload = model["load"]()
batches = [workload.make_batch(model["batch_size"], torch.device("cpu")) for _ in range(2)]
order = {{"fp32": Candidate("fp32"), "pick": Candidate.from_dict(spec["candidate"])}}
if spec["first"] == "pick":
    order = dict(reversed(list(order.items())))
steps, alone, beside = {{}}, {{}}, {{name: [] for name in order}}
with state.precision_settings(IEEE):
    for name, cand in order.items():  # each alone: built and timed before the next is built
        steps[name] = warmed_step(workload, cand, batches)
        alone[name] = [time_round(steps[name], batches) for _ in range(spec["rounds"])]
    for _ in range(spec["rounds"]):  # then both, interleaved as the probe times them
        for name in ("fp32", "pick"):
            beside[name].append(time_round(steps[name], batches))
out = {{
    "first": spec["first"],
    "alone_ms": {{n: 1e3 * statistics.median(v) for n, v in alone.items()}},
    "beside_ms": {{n: 1e3 * statistics.median(v) for n, v in beside.items()}},
}}
open(spec["out"], "w").write(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--processes", type=int, default=4, help="fresh processes; every other one builds the pick first"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mixprec.policy import Candidate

    pick = Candidate(args.policy, channels_last=args.channels_last)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            out = Path(tmp) / f"{i}.json"
            spec = {
                "model": args.model,
                "candidate": pick.to_dict(),
                "rounds": args.rounds,
                "threads": args.threads,
                "first": "fp32" if i % 2 == 0 else "pick",
                "out": str(out),
            }
            subprocess.run([sys.executable, "-c", WORKER, json.dumps(spec)], check=True)
            run = json.loads(out.read_text())
            a, b = run["alone_ms"], run["beside_ms"]
            run["speedup_alone"], run["speedup_beside"] = a["fp32"] / a["pick"], b["fp32"] / b["pick"]
            runs.append(run)
            print(
                f"process {i + 1} ({run['first']} built first): fp32 {a['fp32']:.0f} ms alone, "
                f"{b['fp32']:.0f} ms beside; {pick.label} {a['pick']:.0f} ms alone, "
                f"{b['pick']:.0f} ms beside; "
                f"speedup {run['speedup_alone']:.3f}x alone, {run['speedup_beside']:.3f}x beside",
                flush=True,
            )
    summary = {key: statistics.median(r[key] for r in runs) for key in ("speedup_alone", "speedup_beside")}
    print(f"medians: {summary}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"pick": pick.label, "runs": runs, **summary, "argv": sys.argv[1:]}, indent=1)
        )


if __name__ == "__main__":
    main()
