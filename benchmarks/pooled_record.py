"""Would one record per configuration make the next command repeat the figure? (issue 53)

mixprec already keeps every sweep's speedups per machine and configuration (``repeats.json``), but
only to learn how far apart runs land; each command's figure is still its own sessions'. This
replays the bench_vs_tune runs kept in a results folder, in the order they ran, as if each figure
had pooled this machine's earlier sessions of the same candidate (the last ``--kept``, with the
command's own) by the rule a settled row already pools its sessions with
(:func:`mixprec.measure.results.session_speedup`: a random-effects meta-analysis, their median where
three or more disagree beyond chance). Two records: one per command (tune pools tune's earlier
sessions, bench bench's: the two figures stay independent of each other) and one shared by both.
The plain figures (alone, probe) are measured outside mixprec and stay as they were: they are the
independent check. It measures nothing; it reads what the runs kept (the rows' paired rounds and
the sessions they came in). What it cannot replay: a pooled figure would also have changed some
of tune's decisions, and with them its pick; the figures here are for the pick each run made.

    python benchmarks/pooled_record.py [--results benchmarks/results/cpu-amd-epyc] [--kept 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from mixprec.measure.results import session_speedup
from session_warmup import rows_of

AGREE = 1.10  # the criterion: the largest figure within 10% of the smallest


def sessions_of_rows(rows: list[dict]) -> dict[str, list[list[float]]]:
    """Per candidate label, the sessions of paired rounds its measured rows hold, in order."""
    found: dict[str, list[list[float]]] = defaultdict(list)
    for row in rows:
        ratios = row.get("paired_ratios") or []
        if row.get("status") != "ok" or row.get("baseline_repeat") or not ratios:
            continue
        start = 0
        for size in row.get("sessions") or [len(ratios)]:
            found[row["label"]].append(ratios[start : start + size])
            start += size
    return found


def figure(sessions: list[list[float]]) -> float:
    """The figure of ``sessions`` pooled as a settled row pools its own."""
    values = [v for s in sessions for v in s]
    return session_speedup(values, [len(s) for s in sessions])[0]


def spread(figures: list[float]) -> float:
    return max(figures) / min(figures)


def replay(results: Path, kept: int) -> list[dict]:
    """Each run's figures for its pick: as printed, and pooled with a per-command or a shared record."""
    runs = sorted(
        (int(p.name.split("-")[-1].removesuffix(".json")), p)
        for p in results.glob("bench_vs_tune-*-*.json")
        if p.name.count(".") == 1 and p.name.split("-")[-1].removesuffix(".json").isdigit()
    )
    own: dict[str, dict[str, list]] = {"tune": defaultdict(list), "bench": defaultdict(list)}
    shared: dict[str, list] = defaultdict(list)
    out = []
    for number, path in runs:
        summary = json.loads(path.read_text())
        pick = summary["pick"]
        plain = [summary[k]["speedup"] for k in ("alone", "probe") if summary.get(k)]
        row: dict = {"run": number, "pick": pick, "plain": dict(zip(("alone", "probe"), plain, strict=False))}
        for command in ("tune", "bench"):
            document = json.loads(path.with_suffix(f".{command}.json").read_text())
            measured = sessions_of_rows(rows_of(document))
            now = measured.get(pick, [])
            row[command] = {
                "as_printed": summary[command]["speedup"],
                "replayed": figure(now) if now else None,
                "per_command": figure(own[command][pick][-kept:] + now) if now else None,
                "shared": figure(shared[pick][-kept:] + now) if now else None,
                "sessions": len(now),
                "earlier_sessions": {
                    "per_command": len(own[command][pick][-kept:]),
                    "shared": len(shared[pick][-kept:]),
                },
            }
            for label, sessions in measured.items():
                own[command][label] += sessions
                shared[label] += sessions
        reference = summary["alone"]["speedup"] if summary.get("alone") else summary["probe"]["speedup"]
        for way in ("as_printed", "per_command", "shared"):
            figures = [row["tune"][way], row["bench"][way], reference]
            if None not in figures:
                row[f"spread_{way}"] = spread(figures)
                row[f"spread_with_probe_{way}"] = spread([*figures, summary["probe"]["speedup"]])
        out.append(row)
    return out


def in_a_row(flags: list[bool]) -> int:
    """The longest run of consecutive Trues."""
    best = current = 0
    for flag in flags:
        current = current + 1 if flag else 0
        best = max(best, current)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results" / "cpu-amd-epyc")
    parser.add_argument("--kept", type=int, default=8, help="earlier sessions a record keeps per candidate")
    parser.add_argument(
        "--first", type=int, default=1, help="the first run counted (earlier ones only fill the record)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs = replay(args.results, args.kept)
    counted = [r for r in runs if r["run"] >= args.first]
    print(
        f"{'run':>4} {'pick':<28} {'plain':>6} | {'tune':>17} | {'bench':>17} | "
        "spread printed / per-command / shared"
    )
    for r in counted:
        plain = r["plain"].get("alone") or r["plain"]["probe"]
        cells = [
            f"{r[c]['as_printed']:.2f} {r[c]['per_command'] or 0:.2f} {r[c]['shared'] or 0:.2f}"
            for c in ("tune", "bench")
        ]
        spreads = " / ".join(
            f"{100 * (r.get('spread_' + w, 0) - 1):5.1f}%" for w in ("as_printed", "per_command", "shared")
        )
        print(f"{r['run']:>4} {r['pick']:<28} {plain:6.2f} | {cells[0]:>17} | {cells[1]:>17} | {spreads}")
    summary = {}
    for way in ("as_printed", "per_command", "shared"):
        flags = [r[f"spread_{way}"] <= AGREE for r in counted if f"spread_{way}" in r]
        probed = [r[f"spread_with_probe_{way}"] <= AGREE for r in counted if f"spread_{way}" in r]
        summary[way] = {
            "within_10_percent": sum(flags),
            "runs": len(flags),
            "longest_in_a_row": in_a_row(flags),
            "with_probe_within_10_percent": sum(probed),
            "with_probe_longest_in_a_row": in_a_row(probed),
        }
        print(
            f"{way:>12}: {sum(flags)} of {len(flags)} within 10%, longest run in a row {in_a_row(flags)}; "
            f"the interleaved probe too: {sum(probed)} of {len(probed)}, {in_a_row(probed)} in a row"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"kept": args.kept, "first": args.first, "summary": summary, "runs": runs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
