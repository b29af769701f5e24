"""Does strict fp32 really turn TF32 off? Matmul and convolution speed and bits under each policy.

A square fp32 matmul and a 3x3 convolution are timed under mixprec's ``fp32`` (IEEE),
``tf32`` and ``bf16-mixed`` policies, and their results compared bit for bit and against a
float64 reference. On an H100 SXM the datasheet says 67 TFLOP/s for fp32 and 495 for TF32
(dense): a strict matmul should run at about 1/7 of the TF32 speed and differ in its bits.

    python benchmarks/tf32_probe.py [--size 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import mixprec
import mixprec.hardware.environment
from mixprec import state


def _time_s(fn, min_run_time: float) -> float:
    fn()
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def probe(op: str, size: int, device: str, min_run_time: float) -> dict[str, object]:
    g = torch.Generator(device=device).manual_seed(0)
    if op == "matmul":
        a = torch.randn(size, size, device=device, generator=g)
        b = torch.randn(size, size, device=device, generator=g)
        flops = 2.0 * size**3

        def run(x=a, y=b):
            return x @ y

        ref_size = 1024  # the float64 reference on a corner, to keep it cheap

        def ref_err(out: torch.Tensor) -> float:
            ref = a[:ref_size].double() @ b.double()
            return float((out[:ref_size].double() - ref).norm() / ref.norm())
    else:
        x = torch.randn(64, 256, 56, 56, device=device, generator=g)
        w = torch.randn(256, 256, 3, 3, device=device, generator=g)
        flops = 2.0 * 64 * 256 * 56 * 56 * 256 * 9

        def run(x=x, y=w):
            return F.conv2d(x, y, padding=1)

        def ref_err(out: torch.Tensor) -> float:
            ref = F.conv2d(x[:2].double(), w.double(), padding=1)
            return float((out[:2].double() - ref).norm() / ref.norm())

    rows = {}
    outputs = {}
    for name in ("fp32", "tf32", "bf16-mixed"):
        policy = mixprec.get_policy(name, device=device, check=False)
        with policy.precision_scope(), state.cudnn_benchmark(True):

            def step(policy=policy):
                with policy.autocast():
                    return run()

            seconds = _time_s(step, min_run_time)
            outputs[name] = step().float()
            rows[name] = {
                "tflops": flops / seconds / 1e12,
                "ms": seconds * 1e3,
                "rel_err_vs_fp64": ref_err(outputs[name]),
                "precision_state": {
                    k: v for k, v in state.effective_state().items() if k in ("cuda.matmul", "cudnn.conv")
                },
            }
    rows["fp32"]["bitwise_equal_to_tf32"] = torch.equal(outputs["fp32"], outputs["tf32"])
    rows["fp32"]["speed_ratio_fp32_over_tf32"] = rows["fp32"]["tflops"] / rows["tf32"]["tflops"]
    return {"op": op, "size": size, "results": rows}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--min-run-time", type=float, default=1.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("tf32_probe.py needs a CUDA GPU (or --device cpu --size 256 for a smoke run)", file=sys.stderr)
        return 3
    results = [probe(op, args.size, args.device, args.min_run_time) for op in ("matmul", "conv")]
    for r in results:
        for name, row in r["results"].items():
            print(
                f"{r['op']:>6} {name:>10}: {row['tflops']:7.1f} TFLOP/s  rel err vs fp64 "
                f"{row['rel_err_vs_fp64']:.2e}  {row['precision_state']}"
            )
        fp32 = r["results"]["fp32"]
        print(
            f"{r['op']:>6}: strict/tf32 speed {fp32['speed_ratio_fp32_over_tf32']:.3f}, "
            f"bitwise equal: {fp32['bitwise_equal_to_tf32']}"
        )
    if args.json:
        command = "python benchmarks/tf32_probe.py " + " ".join(sys.argv[1:])
        env = mixprec.hardware.environment.collect(args.device, full=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"benchmark": "tf32_probe", "command": command, "env": env, "results": results}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
