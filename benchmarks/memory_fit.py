"""How well the memory model predicts a peak: for each model and policy, the step's peak measured at
four micro-batch sizes (b, 2b, 4b, 8b), the model fitted on 2b and 4b as ``tune`` and ``bench
--batch-sizes`` fit it, and its error where it extrapolates (8b: where a memory budget binds) and
where it interpolates back (b). On a CPU the peak is MemTracker's tracked tensor bytes, on a GPU
``torch.cuda.max_memory_allocated`` (mixprec.frameworks.torch.memory).

    python benchmarks/memory_fit.py --out benchmarks/results/cpu-amd-epyc
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
from mixprec.measure.memory import fit

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64}
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "zoo:mlp": ("mlp", {}, 16),
    "zoo:gpt2 (2x64, 128 tokens)": ("gpt2", {**TINY, "vocab_size": 512, "seq_len": 128}, 2),
    "zoo:resnet50 (32 px)": ("resnet50", {"image_size": 32}, 2),
    "zoo:vgg19 (32 px)": ("vgg19", {"image_size": 32}, 2),
    "zoo:densenet121 (32 px)": ("densenet121", {"image_size": 32}, 2),
    "hf:gpt2 (2x64, 64 tokens)": ("hf:gpt2", {**TINY, "seq_len": 64}, 2),
    "hf:gpt2 (2x64, 256 tokens)": ("hf:gpt2", {**TINY, "seq_len": 256}, 2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="fp32,bf16-mixed,bf16-true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "memory_fit.json"
    record: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "device": args.device,
        "runs": {},
    }
    worst = 0.0
    for name, (target, options, b) in MODELS.items():
        if args.only and name not in args.only:
            continue
        workload = mixprec.load_workload(target, **options)
        framework = framework_of(workload)
        for policy in args.policies.split(","):
            start = time.perf_counter()
            cand = framework.candidate(policy)
            points = {
                s: framework.peak_memory(workload, cand, args.device, s) for s in (b, 2 * b, 4 * b, 8 * b)
            }
            model = fit(f"{name} {policy}", [points[2 * b], points[4 * b]])
            far = model.predict(8 * b) / points[8 * b].peak_bytes - 1
            near = model.predict(b) / points[b].peak_bytes - 1
            worst = max(worst, abs(far))
            record["runs"][f"{name} {policy}"] = {
                "batch_sizes": [b, 2 * b, 4 * b, 8 * b],
                "peaks": {str(s): p.peak_bytes for s, p in points.items()},
                "fixed_bytes": model.fixed_bytes,
                "per_sample_bytes": model.per_sample_bytes,
                "error_extrapolated_8b": far,
                "error_interpolated_back_b": near,
                "method": points[b].method,
                "seconds": time.perf_counter() - start,
            }
            print(
                f"{name:30s} {policy:10s} fixed {model.fixed_bytes / 2**20:8.1f} MiB, "
                f"{model.per_sample_bytes / 2**10:9.1f} KiB/sample; predicted at {8 * b}: {far:+.2%}, "
                f"at {b}: {near:+.2%}"
            )
            record["worst_extrapolated_error"] = worst
            out.write_text(json.dumps(record, indent=2))
    print(f"worst error where the fit extrapolates: {worst:.2%}; wrote {out}")


if __name__ == "__main__":
    main()
