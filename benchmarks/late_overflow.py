"""Ground truth for a late failure: examples/late_overflow.py trained in a plain PyTorch loop (no
mixprec in it) in fp32, fp16 autocast + GradScaler and bf16 autocast, a few hundred steps each
from the same weights and batches. Prints and writes, per precision: the first step whose loss is
not finite (fp16's head output passed 65504), the steps GradScaler skipped, the loss every 25
steps and at the end (an fp16 loss that stays inf with few skips is no mistake: the L1 loss's
gradient at an inf output is finite, so GradScaler keeps stepping); and beside it what
`mixprec check` (its defaults: 8 steps) predicted.

    python benchmarks/late_overflow.py [--steps 300] --out benchmarks/results/cpu-amd-epyc
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import late_overflow
import mixprec

PRECISIONS = {"fp32": None, "fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def plain_loop(dtype: torch.dtype | None, steps: int) -> dict:
    w = late_overflow.workload()
    torch.manual_seed(123)  # the same batches for every precision
    optimizer = w.optimizer_fn(w.model)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)
    losses, skipped, first_nonfinite = [], [], None
    for step in range(steps):
        batch = w.make_batch(w.default_batch_size, torch.device("cpu"))
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = w.loss_fn(w.model, batch)
        losses.append(float(loss.detach()))
        if first_nonfinite is None and not math.isfinite(losses[-1]):
            first_nonfinite = step
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(optimizer)
        scaler.update()
        if before is not None and scaler.get_scale() < before:
            skipped.append(step)
    return {
        "first_nonfinite_loss_step": first_nonfinite,
        "skipped_steps": skipped,
        "loss_every_25": {s: losses[s] for s in range(0, steps, 25)},
        "final_loss": losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {name: plain_loop(dtype, args.steps) for name, dtype in PRECISIONS.items()}
    start = time.perf_counter()
    checked = mixprec.check(late_overflow.workload(), policies=list(PRECISIONS)[1:], device="cpu", fix=True)
    check_s = time.perf_counter() - start
    predicted = {
        c.label: {
            "verdict": c.verdict,
            "reason": c.reason,
            "predicted_step": (c.outlook.get("at_risk") or {}).get("step"),
            "fix_keep_fp32": c.fix_keep_fp32,
            "fix_note": c.fix_note,
        }
        for c in checked.candidates
    }
    for name, run in runs.items():
        print(
            f"{name:11s} first non-finite loss: {run['first_nonfinite_loss_step']}, "
            f"skipped steps: {len(run['skipped_steps'])} (first: {run['skipped_steps'][:3]}), "
            f"final loss {run['final_loss']:.4g}"
        )
    for name, p in predicted.items():
        print(f"mixprec check {name}: {p['verdict']} ({p['reason']})")
        if p["fix_keep_fp32"]:
            print(f"  fix keep_fp32={p['fix_keep_fp32']}: {p['fix_note']}")
    print(f"mixprec check (8 steps, with --fix) took {check_s:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "late_overflow.json"
    out.write_text(
        json.dumps(
            {
                "command": "python " + " ".join(sys.argv),
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "steps": args.steps,
                "plain_loop": runs,
                "mixprec_check": predicted,
                "check_seconds": check_s,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
