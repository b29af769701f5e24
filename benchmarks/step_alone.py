"""Is mixprec's timed step slower than a plain one when each runs ALONE in a process of its own?
(issue 53: in bench_vs_tune runs 10 and 11 mixprec read bf16-mixed at 1.73x and 1.65x where plain
PyTorch, a variant per loop, read 1.79x and 1.89x.) benchmarks/step_vs_plain.py compared the two steps
interleaved in ONE process, where the pick runs faster after strict fp32's step
(shared_process.py); here every process builds one step, the plain probe's hand-written one
(benchmarks/probe_vs_tune.py) or mixprec's candidate session step (TrainingSession.step, what a
candidate process times), for one candidate, warms it up and times ``--steps`` steps in a row.
``--repeats`` fresh processes per combination, the order of the combinations rotated between
repeats; each combination's figure is the median of its processes' medians.

    python benchmarks/step_alone.py [--candidate bf16-mixed] [--repeats 4] [--steps 16] [--json OUT]

The processes inherit this one's environment: set an allocator's settings on the command line
(``GLIBC_TUNABLES=...``, ``THP_MEM_ALLOC_ENABLE=1``) to time them; the JSON records those it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mixprec.policy import Candidate

HERE = Path(__file__).resolve().parent
# what the processes' pace may depend on, recorded where set
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE", "LD_PRELOAD", "MALLOC_CONF", "OMP_WAIT_POLICY")

WORKER = f"""
import json, statistics, sys, time
sys.path.insert(0, {str(HERE)!r})
import torch
import mixprec
from mixprec import state
from mixprec.frameworks.session import BenchSettings
from mixprec.frameworks.torch.session import TrainingSession, make_batches
from mixprec.policy import Candidate
from probe_vs_tune import IEEE, plain_step
spec = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(2)
workload = mixprec.load_workload("resnet50", image_size=128)
batches = make_batches(workload, 16, torch.device("cpu"), 0, 2)
cand = Candidate.from_dict(spec["candidate"])
with state.precision_settings(IEEE):
    if spec["step"] == "plain":
        plain = plain_step(workload, cand)
        step = lambda i: plain(batches[i % 2])
    else:
        settings = BenchSettings(device="cpu", batch_size=16, threads=2)
        session = TrainingSession(workload, cand, settings, batches)
        step = lambda i: session.step(timed=True)
    for i in range(3):
        step(i)
    times = []
    for i in range(spec["steps"]):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
print(json.dumps({{"median_ms": 1e3 * statistics.median(times), "times_ms": [1e3 * t for t in times]}}))
"""


def time_alone(step: str, candidate: Candidate, steps: int, what: str, env: dict | None = None) -> float:
    """The median ms of ``steps`` steps of ``step`` ("plain" or "mixprec") for ``candidate`` in a
    fresh process (``env``: its environment, else this one's)."""
    spec = {"step": step, "candidate": candidate.to_dict(), "steps": steps}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(spec)], capture_output=True, text=True, check=False, env=env
    )
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["median_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--candidate", default="bf16-mixed", help="the candidate beside strict fp32 (a label)"
    )
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()

    pick = Candidate(args.candidate, channels_last=args.channels_last)
    combos = [
        (step, name, cand)
        for step in ("plain", "mixprec")
        for name, cand in (("fp32", Candidate("fp32")), ("pick", pick))
    ]
    runs: dict[str, list[float]] = {f"{s} {n}": [] for s, n, _ in combos}
    for rep in range(args.repeats):
        order = combos[rep % len(combos) :] + combos[: rep % len(combos)]
        for step, name, cand in order:
            ms = time_alone(step, cand, args.steps, what=f"{step} {name}")
            runs[f"{step} {name}"].append(ms)
            print(f"repeat {rep + 1}: {step:>7} {name}: {ms:.0f} ms", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"{k:>13}: {med[k]:.0f} ms (processes: {', '.join(f'{x:.0f}' for x in v)})")
    plain_x, ours_x = med["plain fp32"] / med["plain pick"], med["mixprec fp32"] / med["mixprec pick"]
    print(f"{pick.label} over strict fp32, each alone: plain {plain_x:.3f}x, mixprec {ours_x:.3f}x")
    if args.json:
        out = {
            "argv": sys.argv,
            "pick": pick.label,
            "ms": runs,
            "median_ms": med,
            "env": {k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ},
            "plain_x": plain_x,
            "mixprec_x": ours_x,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
