"""Is `tune`'s pick the fastest candidate that passes? Tune, then an exhaustive paired sweep.

1. ``mixprec.tune`` on the model with its default settings (budget, compile modes, optimizers).
2. An exhaustive ``mixprec.bench`` of every eager candidate this device supports (every policy x
   both layouts), then of the ``--compile-top`` fastest eager candidates under
   ``torch.compile(mode="default")`` together with tune's pick itself (compile and optimizer
   included), every one paired with strict fp32 eager.
3. Every exhaustive candidate measured faster than tune's pick whose numerics tune did not judge
   is checked now (``mixprec.check`` against strict fp32), so a candidate tune under-measured and
   never checked can still beat the pick; then the best passing exhaustive candidate against
   tune's pick, both as measured by the exhaustive sweep.

    python benchmarks/tune_vs_exhaustive.py --model resnet50 --out benchmarks/results/cpu-NAME/

Compile time is left out of the exhaustive speedups (steady-state steps only); tune's ranking
amortises it over its ``train_steps``, so on a long run the two agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mixprec
from mixprec.checking.check import check
from mixprec.frameworks import framework_of
from mixprec.hardware.device import detect
from mixprec.hardware.environment import collect
from mixprec.policy import Candidate


def _rows(result: Any) -> list[dict[str, Any]]:
    return [
        {
            "label": r.label,
            "candidate": r.candidate.to_dict(),
            "status": str(r.status),
            "reason": r.reason,
            "speedup_vs_fp32": r.speedup_vs_fp32,
            "speedup_ci": list(r.speedup_ci) if r.speedup_ci else None,
            "compile_s": r.compile_s if r.candidate.compile else None,
        }
        for r in result.rows
        if not r.baseline_repeat
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--budget", type=float, default=300.0, help="tune's budget (its default: 300)")
    parser.add_argument("--steps", type=int, default=10, help="paired rounds per exhaustive candidate")
    parser.add_argument("--compile-top", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    load = lambda: mixprec.load_workload(args.model, image_size=args.image_size)  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    tuned = mixprec.tune(load(), budget_s=args.budget, batch_size=args.batch_size, device="cpu")
    tune_s = time.perf_counter() - started
    rec = tuned.recommendation
    # numerics verdicts as tune judged them (a layout or optimizer shares its candidate's verdict)
    passed = {Candidate("fp32")} | {
        c.candidate.numerics for c in (tuned.check.candidates if tuned.check else []) if c.passed
    }

    def passes(row: dict[str, Any]) -> bool:
        return Candidate.from_dict(row["candidate"]).numerics in passed

    started = time.perf_counter()
    workload = load()
    eager = mixprec.bench(
        workload,
        candidates=framework_of(workload).tune_candidates(workload, detect("cpu")),
        batch_size=args.batch_size,
        steps=args.steps,
        device="cpu",
    )
    ok = [r for r in eager.rows if str(r.status) == "ok" and not r.baseline_repeat and r.speedup_vs_fp32]
    fastest = sorted(ok, key=lambda r: r.speedup_vs_fp32, reverse=True)[: args.compile_top]
    second: list[Candidate] = [replace(r.candidate, compile="default") for r in fastest]
    if rec is not None and rec.candidate not in second and (rec.candidate.compile or rec.candidate.optimizer):
        second.append(rec.candidate)
    compiled = mixprec.bench(
        load(), candidates=second, batch_size=args.batch_size, steps=args.steps, device="cpu"
    )
    exhaustive_s = time.perf_counter() - started

    rows = _rows(eager) + _rows(compiled)
    measured = {json.dumps(r["candidate"], sort_keys=True): r for r in rows if r["speedup_vs_fp32"]}
    pick_row = measured.get(json.dumps(rec.candidate.to_dict(), sort_keys=True)) if rec else None
    bar = pick_row["speedup_vs_fp32"] if pick_row else 1.0
    unjudged = {
        Candidate.from_dict(r["candidate"]).numerics
        for r in measured.values()
        if r["speedup_vs_fp32"] > bar and not passes(r)
    }
    started = time.perf_counter()
    checked = (
        [] if not unjudged else check(load(), policies=sorted(unjudged, key=str), device="cpu").candidates
    )
    passed |= {c.candidate.numerics for c in checked if c.passed}
    check_s = time.perf_counter() - started
    eligible = [r for r in measured.values() if passes(r)]
    best = max(eligible, key=lambda r: r["speedup_vs_fp32"])
    pick = pick_row
    outcome = {
        "command": "python " + " ".join(sys.argv),
        "device": detect("cpu").name,
        "env": collect("cpu"),
        "tune": {"seconds": round(tune_s, 1), "pick": rec.label if rec else None, "notes": tuned.notes},
        "tune_speedup": rec.speedup_vs_fp32 if rec else None,
        "numerics_passed": sorted(c.label for c in passed),
        "exhaustive_seconds": round(exhaustive_s, 1),
        "checked_here": [{"label": c.candidate.label, "passed": c.passed} for c in checked],
        "check_seconds": round(check_s, 1),
        "exhaustive_rows": rows,
        "exhaustive_best": best["label"],
        "exhaustive_best_speedup": best["speedup_vs_fp32"],
        "pick_in_exhaustive_speedup": pick["speedup_vs_fp32"] if pick else None,
        "pick_over_best": (pick["speedup_vs_fp32"] / best["speedup_vs_fp32"]) if pick else None,
    }
    stem = args.out / f"tune-vs-exhaustive-{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(outcome, indent=1, default=str))
    lines = [
        f"# tune vs exhaustive: {args.model}, {args.image_size} px, batch {args.batch_size}",
        "",
        f"Command: `{outcome['command']}`. Device: {outcome['device']}.",
        f"tune ({tune_s:.0f} s): **{outcome['tune']['pick']}** at {outcome['tune_speedup']:.2f}x strict fp32"
        if rec
        else "tune: no recommendation",
        f"exhaustive ({exhaustive_s:.0f} s): best passing **{best['label']}** at "
        f"{best['speedup_vs_fp32']:.2f}x ({len(checked)} faster unjudged candidates checked first, "
        f"{check_s:.0f} s);"
        + (
            f" tune's pick measured there at {pick['speedup_vs_fp32']:.2f}x = "
            f"{outcome['pick_over_best']:.1%} of the best"
            if pick
            else " tune's pick not measured there"
        ),
        "",
        "| candidate | status | speedup vs fp32 eager | compile s | numerics (tune) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ci = r["speedup_ci"]
        speed = f"{r['speedup_vs_fp32']:.2f}x" if r["speedup_vs_fp32"] else ""
        speed += f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""
        compile_s = f"{r['compile_s']:.0f}" if r["compile_s"] else ""
        verdict = "pass" if passes(r) else ""
        lines.append(f"| {r['label']} | {r['status']} | {speed} | {compile_s} | {verdict} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
