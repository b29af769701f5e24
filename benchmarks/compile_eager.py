"""Eager vs torch.compile x strict fp32 vs bf16-mixed, on ResNet-50 and a nanoGPT-style GPT.

Every candidate is measured by ``mixprec.bench``: in its own process, warmed up until steady, then
timed in rounds that alternate with the strict-fp32 eager baseline (ABBA), so each speedup is the
median of paired ratios taken at the same moment, with a bootstrap 95% interval. A compiled
candidate's first step (tracing + Inductor) is reported separately as its compile time.

Models (as in issue 11's probe):
  resnet50  torchvision ResNet-50, 128 px, batch 16, SGD; bf16 in channels_last (its fast layout)
  gpt       nanoGPT-style GPT-2: 4 layers x 256, 4 heads, seq 128, vocab 50257, batch 8, AdamW

    python benchmarks/compile_eager.py [--models resnet50,gpt] [--steps 6] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import mixprec
from mixprec.hardware.environment import collect
from mixprec.policy import Candidate

MODELS: dict[str, dict[str, Any]] = {
    "resnet50": {
        "load": lambda: mixprec.load_workload("resnet50", image_size=128),
        "batch_size": 16,
        "bf16_channels_last": True,
    },
    "gpt": {
        "load": lambda: mixprec.load_workload("gpt2", seq_len=128, n_layer=4, n_head=4, n_embd=256),
        "batch_size": 8,
        "bf16_channels_last": False,
    },
}


def candidates(bf16_channels_last: bool) -> list[Candidate]:
    bf16 = Candidate("bf16-mixed", channels_last=bf16_channels_last)
    return [
        Candidate("fp32"),
        bf16,
        Candidate("fp32", compile="default"),
        Candidate(bf16.policy, bf16.channels_last, compile="default"),
    ]


def measure(name: str, steps: int, warmup: int) -> dict[str, Any]:
    spec = MODELS[name]
    workload = spec["load"]()
    started = time.perf_counter()
    result = mixprec.bench(
        workload,
        candidates=candidates(spec["bf16_channels_last"]),
        batch_size=spec["batch_size"],
        steps=steps,
        warmup=warmup,
        device="cpu",
    )
    rows = []
    for row in result.rows:
        if row.baseline_repeat:
            continue
        rows.append(
            {
                "label": row.label,
                "status": str(row.status),
                "reason": row.reason,
                "step_ms": row.step_time_ms.median_ms if row.step_time_ms else None,
                "speedup_vs_fp32_eager": row.speedup_vs_fp32,
                "speedup_ci": list(row.speedup_ci) if row.speedup_ci else None,
                "paired_rounds": len(row.paired_ratios),
                "compile_s": row.compile_s if row.candidate.compile else None,
                "graph_breaks": row.graph_breaks,
                "compute_share": row.compute_share,
            }
        )
    return {
        "model": name,
        "description": workload.description,
        "batch_size": spec["batch_size"],
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": rows,
    }


def markdown(results: list[dict[str, Any]], command: str, device: str) -> str:
    lines = [
        "# Eager vs torch.compile x fp32 vs bf16-mixed",
        "",
        f"Device: {device}. Command: `{command}`.",
        "Speedup: median paired ratio against strict fp32 eager (95% bootstrap interval); compile: the",
        "first step's time beyond a steady step.",
        "",
    ]
    for res in results:
        lines += [
            f"## {res['model']}: {res['description']}, batch {res['batch_size']}",
            "",
            "| candidate | step ms | speedup vs fp32 eager | compile s | graph breaks | matmul/conv share |",
            "|---|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            if r["status"] != "ok":
                lines.append(f"| {r['label']} | {r['status']}: {r['reason']} | | | | |")
                continue
            ci = r["speedup_ci"]
            speed = f"{r['speedup_vs_fp32_eager']:.2f}x" + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else "")
            compile_s = "" if r["compile_s"] is None else f"{r['compile_s']:.0f}"
            breaks = "" if r["graph_breaks"] is None else str(r["graph_breaks"])
            share = "" if r["compute_share"] is None else f"{r['compute_share']:.0%}"
            lines.append(
                f"| {r['label']} | {r['step_ms']:.0f} | {speed} | {compile_s} | {breaks} | {share} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="resnet50,gpt")
    parser.add_argument("--steps", type=int, default=6, help="paired rounds per candidate")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write compile-eager.json and .md here")
    args = parser.parse_args()
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; valid: {', '.join(MODELS)}")
    env = collect("cpu")
    device = env.get("device", {}).get("name") or "cpu"
    results = []
    for name in names:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        results.append(measure(name, args.steps, args.warmup))
    command = "python benchmarks/compile_eager.py " + " ".join(sys.argv[1:])
    text = markdown(results, command, device)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile-eager.json").write_text(
            json.dumps({"command": command, "device": device, "env": env, "results": results}, indent=2)
            + "\n"
        )
        (args.out / "compile-eager.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
