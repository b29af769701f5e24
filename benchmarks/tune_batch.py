"""`tune --batch auto` against the exhaustive (candidate x micro-batch) grid, in the same run.

Under a memory budget that binds (set here so that strict fp32 fits a quarter of the effective
batch, not half: the half-size activations of bf16 fit more), the grid times every eager candidate
tune plans at every micro-batch that divides the effective batch and fits the budget, each with
gradient accumulation to the effective batch (``mixprec.bench_batches``). Then ``mixprec.tune(...,
batch="auto")`` searches the same space. Reported: the pick's throughput in the grid against the
best of the grid among the candidates that pass the numerics check, whether every micro-batch tune
ran is inside the budget (measured), and tune's measuring time against the grid's.

    python benchmarks/tune_batch.py --out benchmarks/results/cpu-amd-epyc
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mixprec
from mixprec.frameworks import framework_of
from mixprec.hardware.device import detect
from mixprec.tuning.batching import divisors

MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt2 (2x128, 64 tokens)": ("gpt2", {"n_layer": 2, "n_head": 2, "n_embd": 128, "seq_len": 64}, 16),
    "resnet50 (32 px)": ("resnet50", {"image_size": 32}, 16),
}


def binding_budget(workload: Any, effective: int, device: str) -> int:
    """Halfway between strict fp32's peak at a quarter and at half the effective batch."""
    framework = framework_of(workload)
    fp32 = mixprec.Candidate("fp32")
    quarter = framework.peak_memory(workload, fp32, device, effective // 4).peak_bytes
    half = framework.peak_memory(workload, fp32, device, effective // 2).peak_bytes
    return (quarter + half) // 2


def run(name: str, target: str, options: dict[str, Any], effective: int, args: argparse.Namespace) -> dict:
    workload = mixprec.load_workload(target, **options)
    framework = framework_of(workload)
    budget = binding_budget(workload, effective, args.device)
    info = detect(args.device)
    planned = [c for c in framework.tune_candidates(workload, info) if framework.support(c, info).supported]
    policies = list(dict.fromkeys(c.policy for c in planned))
    layouts = "both" if any(c.channels_last for c in planned) else "off"
    start = time.perf_counter()
    grid = mixprec.bench_batches(
        workload,
        divisors(effective),
        memory_budget=budget,
        effective_batch=effective,
        policies=",".join(policies),
        channels_last=layouts,
        device=args.device,
        steps=args.steps,
        warmup=1,
    )
    grid_s = time.perf_counter() - start
    start = time.perf_counter()
    tuned = mixprec.tune(
        workload,
        batch="auto",
        memory_budget=budget,
        effective_batch=effective,
        budget_s=args.budget,
        device=args.device,
        steps=args.steps,
        compile_modes=(),
        optimizers=False,
        lint=False,
    )
    tune_s = time.perf_counter() - start
    data = tuned.to_dict()
    rec = data["recommendation"]
    passed = {c["candidate"]["policy"] for c in data["candidates"] if c["status"] in ("pass", "recommended")}
    passed.add("fp32")
    timed = [r for r in grid.rows if r.samples_per_s]
    best = max((r for r in timed if r.candidate.policy in passed), key=lambda r: r.samples_per_s)
    pick = None
    if rec:
        cand = mixprec.Candidate.from_dict(rec["candidate"])
        pick = next(
            (r for r in timed if r.candidate == cand.unbatched and r.batch_size == rec["micro_batch"]), None
        )
    measuring = sum(v for k, v in data["phases"].items() if k in ("batch", "speed", "race"))
    inside = [
        c["peak_memory_bytes"] <= budget
        for c in data["batches"]["candidates"]
        if c["micro_batch"] is not None
    ]
    return {
        "model": name,
        "effective_batch": effective,
        "memory_budget_bytes": budget,
        "grid": {
            "seconds": round(grid_s, 1),
            "points_timed": len(timed),
            "best": {
                "label": best.label,
                "micro_batch": best.batch_size,
                "samples_per_s": best.samples_per_s,
            },
            "rows": [r.to_dict() for r in grid.rows],
        },
        "tune": {
            "seconds": round(tune_s, 1),
            "measuring_seconds": round(measuring, 1),
            "phases": data["phases"],
            "pick": rec["label"] if rec else None,
            "micro_batch": rec["micro_batch"] if rec else None,
            "accumulation_steps": rec["accumulation_steps"] if rec else None,
            "peak_memory_bytes": rec["peak_memory_bytes"] if rec else None,
            "timed_points": data["batches"]["timed_points"],
            "grid_points": data["batches"]["grid_points"],
            "notes": data["notes"],
            "plan": data["batches"],
        },
        "pick_in_grid_samples_per_s": pick.samples_per_s if pick else None,
        "pick_vs_grid_best": pick.samples_per_s / best.samples_per_s if pick else None,
        "every_tuned_micro_batch_inside_budget": all(inside),
        "tune_time_share_of_grid": measuring / grid_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget", type=float, default=300.0, help="tune's time budget (s)")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "device": args.device,
        "runs": [],
    }
    for name, (target, options, effective) in MODELS.items():
        if args.only and name not in args.only:
            continue
        result = run(name, target, options, effective, args)
        record["runs"].append(result)
        best, tuned = result["grid"]["best"], result["tune"]
        print(
            f"{name}: grid best {best['label']}@{best['micro_batch']} {best['samples_per_s']:.1f}/s in "
            f"{result['grid']['seconds']:.0f} s; tune picked {tuned['pick']} "
            f"({result['pick_vs_grid_best']:.3f} of the best in the grid), measuring "
            f"{tuned['measuring_seconds']:.0f} s ({result['tune_time_share_of_grid']:.0%} of the grid's); "
            f"inside the budget: {result['every_tuned_micro_batch_inside_budget']}",
            flush=True,
        )
        (args.out / "tune_batch.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
