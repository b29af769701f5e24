"""How far does an odd slow process move a settled figure? (issue 53: most fresh processes run a step
within 3-7% of each other, a few 10-50% slow, benchmarks/allocator_pace.py.) A planted simulation, no
timing: a settled figure pools sessions, each a fresh pair of processes (strict fp32's and the
candidate's), so a session's paired rounds carry the ratio of the two processes' paces. Each
process is slow with probability ``--slow`` (10-50% slow, uniform), else within a few percent
(``--pace-sd``); each round adds its own noise (``--round-sd``). The first session has 4 rounds (the
sweep's), the settling ones 8 (tune's settling session). For 2-6 sessions, the error of three
poolings against the planted truth: mixprec's (``session_speedup``: DerSimonian-Laird random effects
over the sessions' medians; since this script, their median where three or more disagree beyond
chance), the median of the sessions' medians, and the median of every round;
then the same 12 rounds as 4+8 against three sessions of 4, and tune's settling (the sweep's 4, a
session of 4, and a third of 4 only where the two leave the interval wider than 5% either side).

    python benchmarks/session_outliers.py [--draws 4000] [--slow 0.12] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from mixprec.measure.results import _sessions_of, session_speedup


def pace(rng: random.Random, slow: float, sd: float) -> float:
    """A fresh process's step time over the typical one's."""
    if rng.random() < slow:
        return rng.uniform(1.1, 1.5)
    return math.exp(rng.gauss(0.0, sd))


def draw(
    rng: random.Random, rounds: Sequence[int], args: argparse.Namespace
) -> tuple[list[float], list[int]]:
    """The paired ratios of one settled figure, ``rounds`` paired rounds a session, truth 1.0."""
    values, counts = [], []
    for n in rounds:
        # strict fp32's process slow: the ratio reads high; the candidate's slow: it reads low
        session = pace(rng, args.slow, args.pace_sd) / pace(rng, args.slow, args.pace_sd)
        values += [session * math.exp(rng.gauss(0.0, args.round_sd)) for _ in range(n)]
        counts.append(n)
    return values, counts


def poolings(values: list[float], counts: list[int]) -> dict[str, float]:
    groups = _sessions_of(values, counts)
    return {
        "mixprec": session_speedup(values, counts)[0],
        "median of sessions": statistics.median(statistics.median(g) for g in groups),
        "median of rounds": statistics.median(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--slow", type=float, default=0.12, help="a process's chance to run 10-50%% slow")
    parser.add_argument("--pace-sd", type=float, default=0.025, help="the other processes' spread (log)")
    parser.add_argument("--round-sd", type=float, default=0.05, help="a round's own noise (log)")
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = random.Random(0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for sessions in range(2, 7):
        errors: dict[str, list[float]] = {}
        for _ in range(args.draws):
            for name, figure in poolings(*draw(rng, [4] + [8] * (sessions - 1), args)).items():
                errors.setdefault(name, []).append(abs(math.log(figure)))
        out[str(sessions)] = {
            name: {
                "median_error": math.expm1(statistics.median(e)),
                "p90_error": math.expm1(statistics.quantiles(e, n=10)[-1]),
                "beyond_5_percent": sum(x > math.log(1.05) for x in e) / len(e),
            }
            for name, e in errors.items()
        }
        for name, r in out[str(sessions)].items():
            print(
                f"{sessions} sessions, {name:>18}: median error {100 * r['median_error']:.1f}%, "
                f"90th percentile {100 * r['p90_error']:.1f}%, "
                f"beyond 5% in {100 * r['beyond_5_percent']:.0f}%"
            )
    # the same 12 paired rounds as the sweep's 4 and one settling session of 8, or as three sessions
    # of 4 (tune's default budget gave its ResNet-50 pick 2-4 sessions, 8-21 rounds, in
    # bench_vs_tune runs 8-16 on the EPYC)
    splits: dict[str, float] = {}
    splits_run = [((4, 4), "mixprec"), ((4, 8), "mixprec"), ((4, 4, 4), "mixprec")]
    for rounds, name in [*splits_run, ((4, 4, 4), "median of sessions")]:
        errors = [abs(math.log(poolings(*draw(rng, rounds, args))[name])) for _ in range(args.draws)]
        label = f"{'+'.join(map(str, rounds))} rounds, {name}"
        splits[label] = sum(x > math.log(1.05) for x in errors) / len(errors)
        print(f"{label:>32}: beyond 5% in {100 * splits[label]:.0f}%")
    # tune's settling since MIN_SESSIONS: the sweep's 4 and a session of 4, then one more of 4 only
    # where the two leave the figure's interval wider than 5% either side (they disagree)
    errors, thirds = [], 0
    for _ in range(args.draws):
        values, counts = draw(rng, (4, 4), args)
        figure, (low, high) = session_speedup(values, counts)
        if max(high - figure, figure - low) / figure > 0.05:
            more, more_counts = draw(rng, (4,), args)
            values, counts, thirds = values + more, counts + more_counts, thirds + 1
        errors.append(abs(math.log(session_speedup(values, counts)[0])))
    label = "4+4 (+4 where wide), mixprec"
    splits[label] = sum(x > math.log(1.05) for x in errors) / len(errors)
    splits["share given a third session"] = thirds / args.draws
    third = f"{100 * thirds / args.draws:.0f}% got a third"
    print(f"{label:>32}: beyond 5% in {100 * splits[label]:.0f}% ({third})")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"argv": sys.argv, "settings": vars(args), "by_sessions": out, "twelve_rounds": splits},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
