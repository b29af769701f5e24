"""No false alarms from the monitor: clean runs of small built-in models (a CNN among them), the
nanoGPT example, an `hf:` and a `timm:` model, trained ``--steps`` steps in bf16-mixed and
fp16-mixed under ``mixprec train``'s loop with the monitor at its defaults (``every=None``: every
100 steps or less often, as its cost budget decides; ``--every N`` fixes it; rescue off). Every
finding is a false alarm unless the run really failed (its loss not finite); printed per run,
written to ``--out``/monitor_false_alarms.json as each run ends. ResNet-50 runs bf16-mixed only:
fp16 convolutions take ~2 s a step on a CPU (fp16 for the CNNs is for a GPU run).

    python benchmarks/monitor_false_alarms.py [--steps 2000] --out benchmarks/results/cpu-amd-epyc
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mixprec
from mixprec.monitor import MonitorConfig
from mixprec.monitor.train import train

EX = Path(__file__).resolve().parents[1] / "examples"
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64}
WORKLOADS: dict[str, tuple[str, dict[str, Any], int, tuple[str, ...] | None]] = {
    "zoo:mlp": ("mlp", {}, 64, None),
    "zoo:gpt2": ("gpt2", {**TINY, "vocab_size": 512, "seq_len": 32}, 8, None),
    "examples/nanogpt": (f"{EX / 'nanogpt.py'}:make_workload", {**TINY, "block_size": 32}, 8, None),
    "hf:gpt2": ("hf:gpt2", {**TINY, "seq_len": 32}, 8, None),
    "timm:vit_tiny_patch16_224": ("timm:vit_tiny_patch16_224", {"image_size": 32, "patch_size": 8}, 8, None),
    "zoo:resnet50": ("resnet50", {"image_size": 32}, 8, ("bf16-mixed",)),
}  # name: (target, options, batch, the only policies it runs, or None for --policies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--policies", default="bf16-mixed,fp16-mixed")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--every", type=int, default=None, help="a fixed sampling interval (default: auto)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "monitor_false_alarms.json"
    record: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "steps": args.steps,
        "runs": {},
    }
    alarms = runs = 0
    for name, (target, options, batch, only) in WORKLOADS.items():
        if args.only and name not in args.only:
            continue
        for policy in only or args.policies.split(","):
            start = time.perf_counter()
            result = train(
                mixprec.load_workload(target, **options),
                policy,
                args.steps,
                config=MonitorConfig(every=args.every),
                batch_size=batch,
            )
            failed = bool(result.stopped) or not all(math.isfinite(v) for v in result.losses)
            false = [] if failed else result.findings
            runs += 1
            alarms += len(false)
            record["runs"][f"{name} {policy}"] = {
                "steps": len(result.losses),
                "final_loss": result.losses[-1] if result.losses else None,
                "stopped": result.stopped,
                "skipped": len(result.skipped),
                "every": result.every,
                "samples": len(result.sample_steps),
                "really_failed": failed,
                "findings": result.findings,
                "seconds": time.perf_counter() - start,
            }
            seen = [(f["step"], f["kind"], f["module"]) for f in result.findings]
            print(
                f"{name:28s} {policy:10s} {len(result.losses)} steps, "
                f"final loss {result.losses[-1] if result.losses else float('nan'):.4g}, "
                + (f"STOPPED ({result.stopped}), " if result.stopped else "")
                + f"{len(result.skipped)} skipped, sampled every {result.every}, findings: {seen}"
            )
            record["summary"] = {"runs": runs, "false_alarms": alarms}
            out.write_text(json.dumps(record, indent=2))
    print(f"{runs} clean runs, {alarms} false alarms; wrote {out}")


if __name__ == "__main__":
    main()
