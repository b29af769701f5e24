"""Which part of mixprec's method reads a pick's speedup below the plain probe's? (issue 53: tune's
figure for its pick read below the probe's in 7 of 7 bench_vs_tune runs on the 2-core EPYC, mean
ratio 0.95; bench's in 5 of 7.)

Earlier experiments each ruled one part out on its own, in separate runs whose probes read 1.94x
and 2.09x for the same pair: mixprec's step is not slower than the hand-written one in one process
(step_vs_plain.py), the hand-written steps read the same in two processes as in one
(session_effect.py, whose model has 10 classes), a round's lone first step is not it
(warm_rounds.py). This times the same pair three ways in one run, interleaved, ``--repeats`` times:

  mixprec   ``mixprec.bench`` of the pick in a fresh process (its paired sweep: strict fp32 and the
            candidate, each in a fork-server child of its own, ABBA rounds), ``--rounds`` rounds,
            not settled
  plain x2  probe_vs_tune.duel: the probe's hand-written steps, each variant in a spawned process
            of its own, ``--rounds`` interleaved rounds (about half a second of steps a side, the
            first left out)
  plain x1  bench_vs_tune's probe: the same steps, both variants in one fresh process

    python benchmarks/method_gap.py --model resnet50 --policy bf16-mixed --channels-last [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_vs_tune import PROBE
from mixprec.policy import Candidate
from probe_vs_tune import duel, over
from warm_rounds import BENCH, SIZES, _python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=SIZES, default="resnet50")
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--rounds", type=int, default=8, help="paired rounds per measurement, every method")
    parser.add_argument("--repeats", type=int, default=3, help="times the three methods run, interleaved")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json")
    args = parser.parse_args()
    name, sizes, batch = SIZES[args.model]
    pick = Candidate(args.policy, channels_last=args.channels_last)
    base = {
        "model": name,
        "sizes": sizes,
        "batch_size": batch,
        "threads": args.threads,
        "candidate": pick.to_dict(),
        "policy": pick.policy,
        "channels_last": pick.channels_last,
        "way": "lone",  # warm_rounds' mixprec.bench as mixprec times its rounds
        "rounds": args.rounds,
    }
    figures: dict[str, list[float]] = {"mixprec": [], "plain x2": [], "plain x1": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            out = str(Path(tmp) / "out.json")
            bench = _python(BENCH, {**base, "out": out})
            row = next(r for r in bench["rows"] if r["label"] == pick.label)
            figures["mixprec"].append(row["speedup_vs_fp32"])
            duelled = duel(args.model, {"fp32": Candidate("fp32"), "pick": pick}, 1, args.rounds)
            figures["plain x2"].append(over(duelled, "pick", "fp32")[0])
            probed = _python(PROBE, {"model": args.model, **base, "out": out})
            figures["plain x1"].append(probed["pick"]["speedup_vs_fp32_eager"])
            shown = ", ".join(f"{k} {v[-1]:.3f}x" for k, v in figures.items())
            print(f"repeat {i + 1}/{args.repeats}: {shown}", flush=True)
    medians = {k: statistics.median(v) for k, v in figures.items()}
    print("medians: " + ", ".join(f"{k} {v:.3f}x" for k, v in medians.items()))
    if args.json:
        result = {
            "pick": pick.label,
            "model": args.model,
            "rounds": args.rounds,
            "threads": args.threads,
            "figures": figures,
            "medians": medians,
            "seconds": time.perf_counter() - started,
            "argv": sys.argv[1:],
        }
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
