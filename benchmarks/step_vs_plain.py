"""Is mixprec's timed training step slower than a plain one? (issue 53: tune's and bench's figure
for a pick read below the plain probe's.) In ONE process, interleaved: the plain probe's hand-written
step (benchmarks/probe_vs_tune.py) and mixprec's own candidate session step (TrainingSession.step,
what a candidate process times), for strict fp32 and bf16-mixed+channels_last, ResNet-50 128 px
batch 16; two steps each per round, the first and the second timed apart.

    python benchmarks/step_vs_plain.py [ROUNDS] [OUT.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mixprec
from mixprec import state
from mixprec.frameworks.session import BenchSettings
from mixprec.frameworks.torch.session import TrainingSession, make_batches
from mixprec.policy import Candidate
from probe_vs_tune import IEEE, plain_step


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    torch.manual_seed(0)
    torch.set_num_threads(2)
    workload = mixprec.load_workload("resnet50", image_size=128)
    settings = BenchSettings(device="cpu", batch_size=16, threads=2)
    batches = make_batches(workload, 16, torch.device("cpu"), 0, 2)
    fp32, pick = Candidate("fp32"), Candidate("bf16-mixed", channels_last=True)
    steps: dict[str, Callable[[int], object]] = {}
    with state.precision_settings(IEEE):
        for name, cand in (("plain fp32", fp32), ("plain pick", pick)):
            plain = plain_step(workload, cand)
            steps[name] = lambda i, plain=plain: plain(batches[i % 2])
        for name, cand in (("mixprec fp32", fp32), ("mixprec pick", pick)):
            session = TrainingSession(workload, cand, settings, batches)
            steps[name] = lambda i, session=session: session.step(timed=True)
        for step in steps.values():
            for i in range(3):
                step(i)
        times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in steps}
        names = list(steps)
        for r in range(rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                for k in range(2):
                    start = time.perf_counter()
                    steps[n](k)
                    times[n][k].append(time.perf_counter() - start)
            print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    med = {n: (statistics.median(a), statistics.median(b)) for n, (a, b) in times.items()}
    for n, (a, b) in med.items():
        print(f"{n:>14}: first {a * 1e3:.0f} ms, second {b * 1e3:.0f} ms")
    for k, what in ((0, "first"), (1, "second")):
        plain_x = med["plain fp32"][k] / med["plain pick"][k]
        ours_x = med["mixprec fp32"][k] / med["mixprec pick"][k]
        print(f"{what} step of a round: plain {plain_x:.3f}x, mixprec {ours_x:.3f}x")
    if len(sys.argv) > 2:
        out = {"argv": sys.argv, "times_s": {n: {"first": a, "second": b} for n, (a, b) in times.items()}}
        Path(sys.argv[2]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
