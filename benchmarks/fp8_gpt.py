"""fp8 for speed: fp8-rowwise and fp8-tensorwise against bf16-mixed on the zoo GPT, eager and
compiled, each with its numerics verdict beside its speed.

One `mixprec.bench` (every candidate paired with strict fp32, in its own process) and one
`mixprec.check` of the same candidates (8 steps against strict fp32). torchao's fp8 Linear pays
for its casts in eager mode; compiled, Inductor fuses them into the neighbouring kernels, which is
where torchao's published speedups come from. Only matmuls of a few thousand features gain: the
default width (2048) is where torchao's own tables start to show them; the 50,257-word head is
not a multiple of 16 and stays bf16.

    python benchmarks/fp8_gpt.py --out DIR [--device cuda] [--n-embd 2048] [--n-layer 2]
        [--seq-len 1024] [--batch-size 8] [--no-compile]

On a CPU it runs too (the rehearsal): fp8 rows are refused with the reason, their verdicts are
predictions from the same recipe.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import mixprec
from mixprec.policy import Candidate

POLICIES = ("bf16-mixed", "fp8-rowwise", "fp8-tensorwise")


def candidates(compiled: bool) -> list[Candidate]:
    modes = [None, "default"] if compiled else [None]
    return [Candidate(p, compile=m) for m in modes for p in POLICIES]


def table(bench: mixprec.BenchResult, *checks: mixprec.CheckResult) -> list[dict[str, object]]:
    """One row per candidate: throughput, speedup over strict fp32 (the median of its paired rounds)
    and over bf16-mixed of the same compile mode (the two speedups' ratio), compile seconds, verdict."""
    rows = {r.candidate: r for r in bench.rows if not r.baseline_repeat}
    verdicts = {c.candidate: c for check in checks for c in check.candidates}
    out = []
    for cand, row in rows.items():
        if cand.policy == "fp32":
            continue
        twin = rows.get(Candidate("bf16-mixed", compile=cand.compile))
        tput = row.throughput
        speedup = statistics.median(row.paired_ratios) if row.paired_ratios else None
        twin_speedup = statistics.median(twin.paired_ratios) if twin and twin.paired_ratios else None
        verdict = verdicts.get(cand)
        out.append(
            {
                "candidate": cand.label,
                "status": row.status,
                "reason": row.reason if row.status != "ok" else "",
                "samples_per_s": tput,
                "speedup_vs_fp32": speedup,
                "vs_bf16_mixed": speedup / twin_speedup if speedup and twin_speedup else None,
                "compile_s": row.compile_s,
                "mfu": row.mfu,
                "verdict": verdict.verdict if verdict else None,
                "verdict_reason": verdict.reason if verdict else None,
                "predicted": verdict.predicted if verdict else None,
            }
        )
    return out


def markdown(rows: list[dict[str, object]], title: str) -> str:
    def f(v, fmt, unit=""):
        return format(v, fmt) + unit if isinstance(v, (int, float)) else "-"

    lines = [
        f"### {title}",
        "",
        "| candidate | samples/s | vs strict fp32 | vs bf16-mixed | compile s | MFU | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        status = r["status"] if r["status"] != "ok" else ""
        verdict = f"{r['verdict'] or '-'}" + (" (predicted)" if r["predicted"] else "")
        cells = [
            f"{r['candidate']} {status}",
            f(r["samples_per_s"], ".1f"),
            f(r["speedup_vs_fp32"], ".2f", "x"),
            f(r["vs_bf16_mixed"], ".3f", "x"),
            f(r["compile_s"], ".1f"),
            f(r["mfu"], ".1%"),
            verdict,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--device", default=None)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--check-steps", type=int, default=8)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--table-from", metavar="BENCH_JSON", help="print a saved bench's table and exit")
    args = parser.parse_args(argv)
    if args.table_from:
        saved = mixprec.BenchResult.from_dict(json.loads(Path(args.table_from).read_text()))
        title = f"{saved.description} on {saved.device}, batch {saved.batch_size}"
        print(markdown(table(saved), title))
        return 0
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    workload = mixprec.load_workload(
        "gpt2", seq_len=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head
    )
    cands = candidates(not args.no_compile)
    started = time.perf_counter()
    bench = mixprec.bench(
        workload,
        candidates=cands,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=2,
        device=args.device,
        jsonl=out / "fp8-gpt-bench.jsonl",
    )
    bench_s = time.perf_counter() - started
    (out / "fp8-gpt-bench.json").write_text(json.dumps(bench.to_dict(), indent=1))
    rows = table(bench)
    print(markdown(rows, "speed (no verdicts yet)"), flush=True)

    started = time.perf_counter()
    # the eager candidates' verdicts first, written as soon as they exist: the compiled ones (each a
    # compile per run) come second, so a stage cut by its time limit still has a verdict per format
    checks = []
    for group in ([c for c in cands if c.compile is None], [c for c in cands if c.compile is not None]):
        if not group:
            continue
        try:
            checks.append(mixprec.check(workload, policies=group, steps=args.check_steps, device=args.device))
        except mixprec.MixprecError as exc:  # keep the speed table: it was measured
            print(f"check failed: {exc}", file=sys.stderr)
            continue
        name = "fp8-gpt-check.json" if len(checks) == 1 else "fp8-gpt-check-compiled.json"
        (out / name).write_text(json.dumps(checks[-1].to_dict(), indent=1))
        print(markdown(table(bench, *checks), f"with verdicts ({len(checks)} of 2 checks)"), flush=True)
    check_s = time.perf_counter() - started
    rows = table(bench, *checks)
    title = f"{bench.description} on {bench.device}, batch {args.batch_size}"
    text = markdown(rows, title)
    (out / "fp8-gpt.md").write_text(text)
    (out / "fp8-gpt.json").write_text(
        json.dumps(
            {
                "command": "python benchmarks/fp8_gpt.py " + " ".join(argv or sys.argv[1:]),
                "device": bench.device,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "workload": bench.description,
                "bench_s": round(bench_s, 1),
                "check_s": round(check_s, 1),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(text)
    print(f"bench {bench_s:.0f} s, check {check_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
