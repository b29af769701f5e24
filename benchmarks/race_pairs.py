"""tune's race, one duel, in fresh pairs of processes: how far apart do pairs land?

The race (:mod:`mixprec.measure.race`) measures a rival against the leader in paired rounds, each
candidate in its own process, and pools the rounds as if they were independent. Here the duel of
ResNet-50's bf16-mixed+cl (eager) against the same with its whole step compiled is run in
``--pairs`` fresh process pairs of ``--rounds`` rounds each, as the race would, so the spread
between pairs can be read against the spread within one.

    python benchmarks/race_pairs.py [--pairs 3] [--rounds 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import mixprec
from mixprec.budget import Budget
from mixprec.events import ignore
from mixprec.frameworks import framework_of
from mixprec.frameworks.session import BenchSettings
from mixprec.hardware.environment import collect
from mixprec.measure.compile_cache import use_inductor_cache
from mixprec.measure.race import paired_rounds
from mixprec.policy import Candidate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json")
    args = parser.parse_args()
    use_inductor_cache()  # as tune does: the compiled step comes from Inductor's cache
    workload = mixprec.load_workload("resnet50", image_size=128)
    leader = Candidate("bf16-mixed", True)
    rival = Candidate("bf16-mixed", True, compile="default", compile_scope="step")
    settings = BenchSettings(
        device="cpu", batch_size=16, steps=args.rounds, warmup=3, adaptive_warmup=False, threads=args.threads
    )
    measure = paired_rounds(
        framework_of(workload), workload, settings, isolate=True, events=ignore, budget=Budget()
    )
    pairs = []
    for i in range(args.pairs):
        ratios = list(measure(leader, [rival], args.rounds).get(rival, ()))
        pairs.append(ratios)
        shown = ", ".join(f"{r:.3f}" for r in ratios)
        median = statistics.median(ratios) if ratios else float("nan")
        print(f"pair {i}: leader/rival step time per round [{shown}], median {median:.3f}", flush=True)
    if args.json:
        result = {
            "command": "python benchmarks/race_pairs.py " + " ".join(sys.argv[1:]),
            "leader": leader.label,
            "rival": rival.label,
            "pairs": pairs,
            "pair_medians": [statistics.median(p) for p in pairs if p],
            "env": collect("cpu"),
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
