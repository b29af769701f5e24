"""The seed's benchmark table in TensorFlow/Keras, and the same models and policies in PyTorch next to it.

ResNet-50, VGG-19 and DenseNet-121 (``keras.applications`` / torchvision, ``weights=None``,
synthetic data, categorical cross-entropy, SGD with momentum) train under each policy: img/s,
speedup vs strict FP32 and the loss of the first iteration, in the seed's table format. Within a
framework every candidate is paired with strict fp32 (its steps alternate with the baseline's, in
their own processes), so a busy machine slows both sides of each ratio alike; the two frameworks run
one after the other per model (TensorFlow, then PyTorch), so their throughputs are compared
unpaired: the Keras/PyTorch column is a ratio of medians measured minutes apart.

    python benchmarks/seed_table_tf.py [--device cpu] [--image-size 64] [--batch-size 8] [--out DIR]

On a GPU the defaults of the seed apply (224 px, batch 256, fp32/tf32/fp16-mixed/bf16-mixed).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

import mixprec
import mixprec.hardware.environment
from mixprec.frameworks.keras.environment import collect as tf_collect
from mixprec.keras import load_keras_workload
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.report.jsonio import write_json

MODELS = ("resnet50", "vgg19", "densenet121")
SEED_HEADER = ("Model", "Precision", "Throughput (img/s)", "Speedup (vs FP32)", "Loss (1st iteration)")
# The seed's table: TensorFlow 2.6, one A100 (img/s); FP16 is Keras' mixed_float16.
SEED_A100_TF26 = {
    "resnet50": {"fp32": 455.9, "tf32": 750.6, "fp16-mixed": 1087.6},
    "vgg19": {"fp32": 212.7, "tf32": 550.3, "fp16-mixed": 1099.8},
    "densenet121": {"fp32": 391.9, "tf32": 591.5, "fp16-mixed": 876.2},
}


def seed_rows(model: str, result: BenchResult) -> list[list[str]]:
    """The seed's columns for each row: model, precision, img/s, speedup, first loss (or the status)."""
    rows = []
    for row in result.rows:
        if row.status == "ok":
            cells = [
                f"{row.throughput:.1f}",
                f"{row.speedup_vs_fp32:.2f}x" if row.speedup_vs_fp32 else "",
                f"{row.first_loss:.4f}" if row.first_loss is not None else "",
            ]
        else:
            cells = [row.status, "", row.reason[:70]]
        rows.append([model, row.label, *cells])
    return rows


def _ok(result: BenchResult, policy: str) -> BenchRow | None:
    return next(
        (r for r in result.rows if r.policy == policy and r.status == "ok" and not r.channels_last), None
    )


def comparison(model: str, tf: BenchResult, pt: BenchResult | None, policies: list[str]) -> list[list[str]]:
    """Per policy: Keras and PyTorch img/s, each one's speedup vs its own strict fp32, and Keras/PyTorch."""
    rows = []
    for policy in policies:
        k, p = _ok(tf, policy), (_ok(pt, policy) if pt else None)
        ratio = f"{k.throughput / p.throughput:.2f}" if k and p and k.throughput and p.throughput else ""
        rows.append(
            [
                model,
                policy,
                f"{k.throughput:.1f}" if k and k.throughput else "-",
                f"{k.speedup_vs_fp32:.2f}x" if k and k.speedup_vs_fp32 else "-",
                f"{p.throughput:.1f}" if p and p.throughput else "-",
                f"{p.speedup_vs_fp32:.2f}x" if p and p.speedup_vs_fp32 else "-",
                ratio,
            ]
        )
    return rows


def table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--policies", default=None, help="default: fp32,bf16-mixed,fp16-mixed on CPU, + tf32 on GPU"
    )
    parser.add_argument("--image-size", type=int, default=None, help="default: 64 on CPU, 224 on GPU")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 8 on CPU, 256 on GPU")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-torch", action="store_true", help="TensorFlow only")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<device>-<short name>")
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    policies = (
        args.policies or ("fp32,tf32,fp16-mixed,bf16-mixed" if gpu else "fp32,bf16-mixed,fp16-mixed")
    ).split(",")
    size = args.image_size or (224 if gpu else 64)
    batch = args.batch_size or (256 if gpu else 8)
    info = mixprec.detect(args.device)
    short = re.sub(
        r"[^a-z0-9]+", "-", (info.name if gpu else platform.processor() or info.name).lower()
    ).strip("-")
    slug = ("cpu-" if not gpu else "") + re.sub(r"-(r|tm)(?=-|$)", "", short).strip("-")[:40]
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / slug
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python benchmarks/seed_table_tf.py", *sys.argv[1:]])
    env = tf_collect(args.device, full=True)
    tf_env = env["tensorflow"]
    meta = {
        "command": f"`{command}`",
        "device": info.name,
        "tensorflow / keras": f"{tf_env['tensorflow_version']} / {tf_env['keras_version']}",
        "torch": env["torch_version"],
        "threads": str(env["threads"]),
        "image size / batch": f"{size} px / {batch}",
        "steps": f"{args.warmup} warm-up (more until steady) + at least {args.steps} paired rounds",
        "pairing": "within a framework: every candidate paired with strict fp32 (ABBA rounds, own "
        "processes); "
        "TensorFlow vs PyTorch: sequential per model, unpaired",
        # a shared machine is busy with other work: say how busy next to the figures
        "load average at start (1/5/15 min)": " / ".join(f"{x:.1f}" for x in os.getloadavg())
        + f" on {os.cpu_count()} CPUs",
    }
    results: list[dict[str, Any]] = []
    seed_tf, seed_pt, side = [], [], []
    for model in args.models.split(","):
        tf_result = mixprec.bench(
            load_keras_workload(model, image_size=size),
            policies=policies,
            batch_size=batch,
            steps=args.steps,
            warmup=args.warmup,
            min_time_s=1.0,
            device=args.device,
        )
        seed_tf += seed_rows(model, tf_result)
        pt_result = None
        if not args.no_torch:
            pt_result = mixprec.bench(
                mixprec.load_workload(model, image_size=size),
                policies=policies,
                channels_last="off",
                batch_size=batch,
                steps=args.steps,
                warmup=args.warmup,
                min_time_s=1.0,
                device=args.device,
            )
            seed_pt += seed_rows(model, pt_result)
        side += comparison(model, tf_result, pt_result, policies)
        results.append(
            {
                "model": model,
                "tensorflow": tf_result.to_dict(),
                "torch": pt_result.to_dict() if pt_result else None,
            }
        )
        for line in table(SEED_HEADER, seed_rows(model, tf_result)):
            print(line, flush=True)
        meta["load average after the last model"] = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        lines = [
            "# The seed's table in TensorFlow/Keras and PyTorch on this machine",
            "",
            *(f"- {k}: {v}" for k, v in meta.items()),
            "",
            "## TensorFlow / Keras (the seed's framework)",
            "",
            *table(SEED_HEADER, seed_tf),
            "",
            "## PyTorch, same models and policies",
            "",
            *(table(SEED_HEADER, seed_pt) if seed_pt else ["(not run)"]),
            "",
            "## Side by side",
            "",
            *table(
                [
                    "Model",
                    "Policy",
                    "Keras img/s",
                    "Keras speedup",
                    "PyTorch img/s",
                    "PyTorch speedup",
                    "Keras / PyTorch",
                ],
                side,
            ),
            "",
            "Speedups are paired within each framework (median paired ratio against that framework's strict "
            "fp32). Keras / PyTorch is a ratio of throughputs measured one after the other (unpaired). The "
            "seed's own A100 figures (TensorFlow 2.6): "
            + "; ".join(
                f"{m}: " + ", ".join(f"{p} {v}" for p, v in d.items()) for m, d in SEED_A100_TF26.items()
            )
            + " img/s.",
            "",
        ]
        (out / "seed_table_tf.md").write_text("\n".join(lines), encoding="utf-8")
        write_json(
            out / "seed_table_tf.json",
            "seed_table_tf",
            env,
            {"command": command, "meta": meta, "results": results},
        )
    print(f"wrote {out / 'seed_table_tf.md'} and {out / 'seed_table_tf.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
