"""No false alarms: workloads that train fine for 1,000+ steps in a plain loop in bf16 and fp16 must
not be called ``at-risk`` by a default `mixprec check`.

For each workload (every zoo model, the examples, models by name; small configurations so a CPU
runs them): a plain PyTorch loop (no mixprec in it) in fp32, bf16 autocast and fp16 autocast +
GradScaler for ``--steps`` steps from the same weights and batches, and the default check (8
steps) of bf16-mixed and fp16-mixed. ``--run-budget-s`` caps each loop's time (the steps it ran are
recorded: fp16 convolutions on a CPU without fp16 arithmetic run 10-20x slower than fp32). A
precision "trains fine" when its loss stays finite after
the scaler's start-up, GradScaler skips at most 1% of the steps after it, and its final loss (mean
of the last 50 steps) is within 5% (+0.05) of fp32's. Printed per workload: the verdicts, and the
calibration figures: of every layer trend the check fitted whose crossing fell within the run,
the largest Kendall's tau and R^2, and of the trending ones the fewest bits left per bit grown over
the check (a trend is at-risk only with tau >= MIN_TAU, R^2 >= MIN_R2, and at most BITS_FACTOR
bits left per bit grown, within HORIZON times the checked steps). Results are written to
``--out``/false_alarms.json as each workload ends.

    python benchmarks/false_alarms.py [--steps 1000] [--run-budget-s S] [--only NAME ...] --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mixprec
from mixprec.checking.check import TRAIN_STEPS
from mixprec.numerics.trend import (
    BITS_FACTOR,
    HORIZON,
    MIN_R2,
    MIN_TAU,
    UNDERFLOW_LIMIT,
    LayerSeries,
    predict,
)

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"
TINY_GPT = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512}
# name: (target, options, batch size)
WORKLOADS: dict[str, tuple[str, dict[str, Any], int]] = {
    "zoo:mlp": ("mlp", {}, 64),
    "zoo:gpt2": ("gpt2", {**TINY_GPT, "seq_len": 32}, 8),
    "zoo:resnet50": ("resnet50", {"image_size": 32}, 8),
    "zoo:vgg19": ("vgg19", {"image_size": 32}, 8),
    "zoo:densenet121": ("densenet121", {"image_size": 32}, 8),
    "examples/nanogpt": (
        f"{EX / 'nanogpt.py'}:make_workload",
        {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32},
        8,
    ),
    "examples/hf_model": (
        f"{EX / 'hf_model.py'}:make_workload",
        {"hidden_size": 64, "num_hidden_layers": 2, "seq_len": 32},
        8,
    ),
    "examples/timm_model": (
        f"{EX / 'timm_model.py'}:make_workload",
        {"image_size": 32, "num_classes": 10},
        8,
    ),
    "hf:gpt2": ("hf:gpt2", {"seq_len": 32, "n_layer": 2, "n_embd": 64, "n_head": 2}, 8),
    "hf:bert": (
        "hf:bert",
        {
            "seq_len": 32,
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 2,
            "intermediate_size": 128,
        },
        8,
    ),
    "hf:llama": (
        "hf:llama",
        {
            "seq_len": 32,
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
        },
        8,
    ),
    "timm:resnet18": ("timm:resnet18", {"image_size": 32}, 8),
    "timm:vit_tiny_patch16_224": ("timm:vit_tiny_patch16_224", {"image_size": 32, "patch_size": 8}, 8),
}
PRECISIONS = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
START_UP = 20  # steps GradScaler may spend finding its scale
FINE = {True: "fine", False: "NOT fine", None: "inconclusive"}


def load(target: str, options: dict[str, Any]) -> mixprec.Workload:
    return mixprec.load_workload(target, **options)


def plain_loop(
    target: str, options: dict[str, Any], batch: int, dtype: torch.dtype | None, steps: int, budget_s: float
) -> dict:
    w = load(target, options)  # rebuilt: the same seeded weights and batch sequence for every precision
    model = w.model
    optimizer = w.make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)
    losses, skipped = [], []
    start = time.perf_counter()
    for step in range(steps):
        if time.perf_counter() - start > budget_s:
            break  # fp16 convolutions on a CPU without fp16 arithmetic run 10-20x slower than fp32
        data = w.make_batch(batch, torch.device("cpu"))
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = w.loss_fn(model, data)
        losses.append(float(loss.detach()))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(optimizer)
        scaler.update()
        if before is not None and scaler.get_scale() < before:
            skipped.append(step)
    return {"losses": losses, "skipped": skipped}


def trains_fine(run: dict, fp32: dict, steps: int) -> tuple[bool | None, str]:
    """True / False, or None (inconclusive) when the loop could not run its ``steps`` in its time."""
    n = min(len(run["losses"]), len(fp32["losses"]))  # compared over the steps both ran
    run = {"losses": run["losses"][:n], "skipped": [s for s in run["skipped"] if s < n]}
    fp32 = {"losses": fp32["losses"][:n]}
    late = run["losses"][START_UP:]
    if not all(math.isfinite(v) for v in late):
        first = START_UP + next(i for i, v in enumerate(late) if not math.isfinite(v))
        return False, f"non-finite loss at step {first}"
    late_skips = [s for s in run["skipped"] if s >= START_UP]
    if len(late_skips) > 0.01 * len(late):
        return False, f"{len(late_skips)} skipped steps after start-up"
    final, ref = statistics.fmean(run["losses"][-50:]), statistics.fmean(fp32["losses"][-50:])
    if final > ref * 1.05 + 0.05:
        return False, f"final loss {final:.4g} vs fp32 {ref:.4g}"
    if n < steps:
        return None, f"inconclusive: fine for the {n} steps its time allowed, not {steps}"
    return True, f"{n} steps, final loss {final:.4g} (fp32 {ref:.4g})"


def closest_calls(check: Any) -> dict[str, float]:
    """Of the trends fitted on the check's series that cross within the run: the largest tau and R^2."""
    fmt = "fp16" if check.candidate.policy.startswith("fp16") else "bf16"
    from mixprec.numerics.limits import FORMATS

    taus, r2s, ratios = [0.0], [0.0], [math.inf]
    for data in check.series:
        s = LayerSeries.from_dict(data)
        for direction, values, limit in (
            ("forward", s.forward, FORMATS[fmt].max_finite),
            ("backward", s.backward, FORMATS[fmt].max_finite),
            ("underflow", s.underflow, UNDERFLOW_LIMIT),
        ):
            p = predict(values, limit, layer=s.name, direction=direction, fmt=fmt)
            if p is not None and p.step is not None and p.step <= TRAIN_STEPS and p.growth_bits > 0:
                taus.append(p.tau)
                r2s.append(p.r2)
                if p.trending and p.gained_bits > 0:
                    ratios.append(p.headroom_bits / p.gained_bits)
    return {"max_tau": max(taus), "max_r2": max(r2s), "min_bits_left_per_bit_grown": min(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--run-budget-s", type=float, default=math.inf, help="cap on each plain loop's time")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "false_alarms.json"
    record: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "steps": args.steps,
        "thresholds": {"MIN_TAU": MIN_TAU, "MIN_R2": MIN_R2, "BITS_FACTOR": BITS_FACTOR, "HORIZON": HORIZON},
        "workloads": {},
    }
    alarms = healthy = 0
    for name, (target, options, batch) in WORKLOADS.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            runs = {
                p: plain_loop(target, options, batch, d, args.steps, args.run_budget_s)
                for p, d in PRECISIONS.items()
            }
            checked = mixprec.check(
                load(target, options), policies=list(PRECISIONS)[1:], batch_size=batch, device="cpu"
            )
        except Exception as exc:  # one workload's failure is recorded, the rest still run
            record["workloads"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: error: {type(exc).__name__}: {exc}")
            continue
        entry: dict[str, Any] = {"seconds": 0.0, "reference_note": checked.reference_note}
        for c in checked.candidates:
            fine, why = trains_fine(runs[c.label], runs["fp32"], args.steps)
            false_alarm = fine is True and c.verdict == "at-risk"
            healthy += fine is True
            alarms += false_alarm
            entry[c.label] = {
                "plain_loop_steps": len(runs[c.label]["losses"]),
                "plain_loop_trains_fine": fine,
                "plain_loop": why,
                "late_skips": len([s for s in runs[c.label]["skipped"] if s >= START_UP]),
                "verdict": c.verdict,
                "reason": c.reason,
                "false_alarm": false_alarm,
                "evidence": c.evidence,
                **closest_calls(c),
            }
            print(
                f"{name:26s} {c.label:10s} plain loop: {FINE[fine]} ({why}); check: "
                f"{c.verdict}; closest trend: tau {entry[c.label]['max_tau']:.2f}, "
                f"R^2 {entry[c.label]['max_r2']:.2f}, "
                f"{entry[c.label]['min_bits_left_per_bit_grown']:.1f} bits left per bit grown"
                + ("  FALSE ALARM" if false_alarm else "")
            )
        entry["seconds"] = time.perf_counter() - start
        record["workloads"][name] = entry
        record["summary"] = {"healthy_runs": healthy, "false_alarms": alarms}
        out.write_text(json.dumps(record, indent=2))
    print(f"{healthy} runs train fine in a plain loop; {alarms} of them called at-risk; wrote {out}")


if __name__ == "__main__":
    main()
