"""Is warm-up left in a session's first paired rounds? (issue 53 names it as a cause to test: a
settling session of 4-8 rounds whose first rounds still read high would pull its median up.)

Reads the rows kept in result files (``paired_ratios`` with the ``sessions`` they came in: bench's
and tune's rows in ``bench_vs_tune-*.bench.json`` / ``.tune.json``, and any other result with rows)
and compares each session's first and second round with the median of its rounds after them, for a
row's first session (a sweep's) and for the later ones (settling sessions: fresh processes).
No measuring: it reads what earlier runs kept.

    python benchmarks/session_warmup.py [--results benchmarks/results/cpu-amd-epyc] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

MIN_ROUNDS = 4  # a session needs two rounds after its first two to compare them with


def rows_of(document: object) -> list[dict]:
    """The measured rows of a bench result (``rows``) or a tune result (``bench.rows``)."""
    if not isinstance(document, dict):
        return []
    rows = document.get("rows") or (document.get("bench") or {}).get("rows")
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def first_rounds(results: Path) -> dict[str, list[float]]:
    """Each session's round 0 and round 1 over the median of its later rounds, by kind of session."""
    found: dict[str, list[float]] = defaultdict(list)
    for path in sorted(results.glob("*.json")):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for row in rows_of(document):
            ratios, sessions = row.get("paired_ratios") or [], row.get("sessions") or []
            if not ratios or not sessions or sum(sessions) != len(ratios):
                continue
            start = 0
            for index, rounds in enumerate(sessions):
                session, start = ratios[start : start + rounds], start + rounds
                if rounds < MIN_ROUNDS:
                    continue
                rest = statistics.median(session[2:])
                kind = "first session" if index == 0 else "later sessions"
                found[f"{kind}, round 0"].append(session[0] / rest)
                found[f"{kind}, round 1"].append(session[1] / rest)
    return found


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "sessions": len(ordered),
        "median": statistics.median(ordered),
        "q25": ordered[len(ordered) // 4],
        "q75": ordered[3 * len(ordered) // 4],
        "share_above": sum(v > 1 for v in ordered) / len(ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(Path(__file__).parent / "results" / "cpu-amd-epyc"))
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    table = {kind: summary(values) for kind, values in sorted(first_rounds(Path(args.results)).items())}
    for kind, s in table.items():
        print(
            f"{kind}: {s['sessions']} sessions, median {s['median']:.3f} of the later rounds "
            f"[q25 {s['q25']:.3f}, q75 {s['q75']:.3f}], above them in {s['share_above']:.0%}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"argv": sys.argv, "results": args.results, "rounds": table}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
