"""Reproduce the seed's benchmark table on a GPU, next to the seed's own A100 figures.

ResNet-50, VGG-19 and DenseNet-121 training at 224 px on synthetic data under strict fp32
(TF32 off for cuBLAS *and* cuDNN), tf32, fp16-mixed and bf16-mixed, NCHW and channels_last:
throughput, speedup over strict fp32, first-iteration loss, peak memory and MFU against the
card's datasheet peak. Each model's rows stream to ``<out>/seed_table.jsonl`` as they finish,
and ``<out>/seed_table.json`` / ``.md`` carry the exact command and the device (name, driver,
CUDA, cuDNN and torch versions). The seed's table was measured with TensorFlow 2.6 on an A100
(``tf.keras.applications``, synthetic data); published anchors for other GPUs are listed too.

    python benchmarks/seed_table.py [--batch-size 256] [--steps 15] [--warmup 5] [--out DIR]

`--device cpu --image-size 32 --batch-size 2 --steps 1` exercises the script without a GPU.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

import mixprec
import mixprec.hardware.environment
from mixprec.measure.results import BenchRow
from mixprec.report.format import fmt_bytes
from mixprec.report.jsonio import write_json

MODELS = ("resnet50", "vgg19", "densenet121")
POLICIES = "fp32,tf32,fp16-mixed,bf16-mixed"

# The seed's table: TensorFlow 2.6, one A100, img/s (FP16 is Keras' mixed_float16).
SEED_A100_TF26 = {
    "resnet50": {"fp32": 455.9, "tf32": 750.6, "fp16-mixed": 1087.6},
    "vgg19": {"fp32": 212.7, "tf32": 550.3, "fp16-mixed": 1099.8},
    "densenet121": {"fp32": 391.9, "tf32": 591.5, "fp16-mixed": 876.2},
}
SEED_FIRST_LOSS = {"resnet50": 7.4576, "vgg19": 6.9078, "densenet121": 6.9614}
ANCHORS = (
    "NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 training, A100 80GB, batch 256: "
    "TF32 ~938 img/s (NCHW), AMP fp16 + channels_last ~2470 img/s",
    "Lambda Labs ResNet-50 training benchmark, H100 SXM, NCHW: TF32 1895 img/s, AMP 2791 img/s",
    "Lambda Labs ResNet-50 training benchmark, H200, NCHW, synthetic data: TF32 2259 img/s, "
    "AMP 3079 img/s (1.36x)",
)
# ResNet-50's public record per GPU (Lambda's PyTorch training benchmark, NCHW, synthetic data):
# img/s of TF32 and AMP (fp16), set beside this run's NCHW tf32 and fp16-mixed rows
PUBLIC_RESNET50 = {
    "H200": {"tf32": 2259.0, "fp16-mixed": 3079.0},
    "H100": {"tf32": 1895.0, "fp16-mixed": 2791.0},
}


def beside_the_record(device: str, rows: list[BenchRow]) -> list[str]:
    """This run's NCHW ResNet-50 tf32 and fp16-mixed rows beside the public record for the GPU,
    with both AMP/TF32 ratios; nothing where the GPU has no record."""
    record = next((r for gpu, r in PUBLIC_RESNET50.items() if gpu in device), None)
    ours = {  # the eager NCHW rows with the default optimizer: what the record ran
        r.policy: r.throughput
        for r in rows
        if not r.channels_last
        and r.throughput
        and r.candidate.compile is None
        and r.candidate.optimizer is None
    }
    if record is None or not ours:
        return []
    lines = ["", f"ResNet-50 beside the public record for the {device} (Lambda, NCHW, synthetic data):", ""]
    for policy, theirs in record.items():
        mine = ours.get(policy)
        got = f"{mine:,.0f} img/s, {mine / theirs:.2f}x the record" if mine else "not measured"
        lines.append(f"- {policy}: record {theirs:,.0f} img/s; this run {got}")
    if ours.get("tf32") and ours.get("fp16-mixed"):
        lines.append(
            f"- fp16-mixed over tf32: record {record['fp16-mixed'] / record['tf32']:.2f}x; "
            f"this run {ours['fp16-mixed'] / ours['tf32']:.2f}x"
        )
    return lines


def _row_cells(model: str, row: BenchRow) -> list[str]:
    seed = SEED_A100_TF26.get(model, {}).get(row.policy) if not row.channels_last else None
    return [
        model,
        row.label,
        row.status,
        f"{row.throughput:.1f}" if row.throughput else "",
        f"{row.speedup_vs_fp32:.2f}" if row.speedup_vs_fp32 else "",
        f"{row.first_loss:.6f}" if row.first_loss is not None else "",
        f"{row.mfu:.1%}" if row.mfu else "",
        f"{row.achieved_tflops:.1f}" if row.achieved_tflops else "",
        (fmt_bytes(row.peak_memory_bytes) or "n/a") if row.step_time_ms else "",
        f"{seed:.1f}" if seed else "",
        row.reason[:80],
    ]


HEADER = (
    "Model",
    "Precision",
    "status",
    "Throughput (img/s)",
    "Speedup (vs strict FP32)",
    "Loss (1st iteration)",
    "MFU",
    "TFLOP/s",
    "peak memory",
    "seed: A100, TF 2.6 (img/s)",
    "note",
)


def markdown(model_rows: list[tuple[str, list[BenchRow]]], meta: dict[str, str]) -> str:
    lines = [
        "# The seed's table on this GPU",
        "",
        *(f"- {k}: {v}" for k, v in meta.items()),
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for model, rows in model_rows:
        for row in rows:
            lines.append("| " + " | ".join(_row_cells(model, row)) + " |")
    lines += [
        "",
        "Strict FP32 means TF32 off for cuBLAS and cuDNN (PyTorch enables TF32 for cuDNN "
        "convolutions by default). The seed's FP32 column is TensorFlow's FP32 with TF32 disabled, "
        "its FP16 column Keras' mixed_float16. Seed first-iteration losses: "
        + ", ".join(f"{m} {v}" for m, v in SEED_FIRST_LOSS.items())
        + " (ln(1000) = 6.9078 is the loss of a uniform guess).",
        "",
        "Published anchors:",
        *(f"- {a}" for a in ANCHORS),
        *(
            line
            for model, rows in model_rows
            if model == "resnet50"
            for line in beside_the_record(meta["device"], rows)
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<device name>")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in <out>/*.jsonl")
    parser.add_argument(
        "--cudnn-benchmark",
        choices=("on", "off"),
        default="on",
        help="cuDNN autotuning (on: as NVIDIA's recipes; off: cuDNN's heuristics, no minutes-long tuning)",
    )
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("seed_table.py needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 3
    info = mixprec.detect(args.device)
    slug = re.sub(r"[^a-z0-9]+", "-", info.name.lower()).strip("-")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / slug
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/seed_table.py " + " ".join(sys.argv[1:])
    env = mixprec.hardware.environment.collect(args.device, full=True)
    system = env.get("system", {})
    meta = {
        "command": f"`{command}`",
        "device": info.name,
        "driver / CUDA runtime": f"{system.get('nvidia_driver_version')} / {env['torch_cuda_version']}",
        "cuDNN": str(env["cudnn_version"]),
        "torch": env["torch_version"],
        "batch size": str(args.batch_size),
        "image size": f"{args.image_size} px",
        "steps": f"{args.warmup} warm-up + at least {args.steps} timed (median)",
    }
    model_rows: list[tuple[str, list[BenchRow]]] = []
    results = []
    for name in args.models.split(","):
        workload = mixprec.load_workload(name, image_size=args.image_size)
        result = mixprec.bench(
            workload,
            policies=args.policies,
            channels_last="both",
            batch_size=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
            device=args.device,
            jsonl=out / f"seed_table-{name}.jsonl",
            resume=args.resume,
            cudnn_benchmark=args.cudnn_benchmark == "on",
        )
        results.append(result)
        model_rows.append((name, result.rows))
        for row in result.rows:
            print(" | ".join(_row_cells(name, row)), flush=True)
        # Written after every model, so a run cut short keeps what it measured.
        write_json(
            out / "seed_table.json",
            "seed_table",
            env,
            {
                "command": command,
                "device_name": info.name,
                "meta": meta,
                "results": [r.to_dict() for r in results],
            },
        )
        (out / "seed_table.md").write_text(markdown(model_rows, meta), encoding="utf-8")
    print(f"wrote {out / 'seed_table.json'} and {out / 'seed_table.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
