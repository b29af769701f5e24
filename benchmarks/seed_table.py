"""Reproduce the seed's benchmark table on a GPU.

ResNet-50, VGG-19 and DenseNet-121 training at 224 px under strict fp32, tf32, fp16-mixed
and bf16-mixed, NCHW and channels_last: throughput, speedup over fp32, first-iteration loss,
plus peak memory and MFU. Results go to benchmarks/results/seed_table-<device>.json (and
.md) with the exact command and the device name; commit them whenever this runs on a GPU.

    python benchmarks/seed_table.py [--batch-size 128] [--steps 30] [--warmup 10]

`--device cpu --image-size 32 --batch-size 2 --steps 1` exercises the script without a GPU.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

import mixprec
from mixprec.report.bench import markdown_table
from mixprec.report.jsonio import write_json

MODELS = ("resnet50", "vgg19", "densenet121")
POLICIES = "fp32,tf32,fp16-mixed,bf16-mixed"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("seed_table.py needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 3
    info = mixprec.detect(args.device)
    slug = re.sub(r"[^a-z0-9]+", "-", info.name.lower()).strip("-")
    command = "python benchmarks/seed_table.py " + " ".join(sys.argv[1:])
    results = []
    for name in args.models.split(","):
        workload = mixprec.load_workload(name, image_size=args.image_size)
        result = mixprec.bench(
            workload,
            policies=POLICIES,
            channels_last="both",
            batch_size=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
            device=args.device,
        )
        results.append(result)
        print(markdown_table(result), flush=True)
    out = Path(args.out)
    data = {"command": command, "device_name": info.name, "results": [r.to_dict() for r in results]}
    path = write_json(out / f"seed_table-{slug}.json", "seed_table", results[0].env, data)
    md = [f"Command: `{command}`  ", f"Device: {info.name}", ""] + [markdown_table(r) for r in results]
    (out / f"seed_table-{slug}.md").write_text("\n".join(md), encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
