"""Does `mixprec bench` report what a hand-written PyTorch loop measures?

ResNet-50 on the CPU (128 px, batch 16): strict fp32 and bf16-mixed + channels_last, each
timed by mixprec's sweep and by a plain loop written by the book, with the same warm-up,
the same number of timed steps and the same statistic (median step time). The two are
interleaved for several rounds (this class of shared 2-core VM drifts by 10-20% within a
minute) and the figure is the median of the per-round ratios. Agreement target: within 5%.
Also prints the bf16-mixed+channels_last speedup over fp32 from the same rounds.

    python benchmarks/compare_plain.py [--rounds 3] [--steps 4] [--warmup 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torchvision
from torch import nn

import mixprec
from mixprec.hardware.environment import collect


def plain_loop(image_size: int, batch_size: int, steps: int, warmup: int, bf16_channels_last: bool) -> float:
    """Median step time (s) of a plain training loop: no mixprec anywhere."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torchvision.models.resnet50(weights=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=gen)
    y = torch.randint(0, 1000, (batch_size,), generator=gen)
    if bf16_channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_channels_last):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    workload = mixprec.load_workload("resnet50", image_size=args.image_size)
    candidates = (("fp32", "fp32", "off", False), ("bf16-mixed+cl", "bf16-mixed", "on", True))
    per_round: dict[str, list[tuple[float, float]]] = {label: [] for label, *_ in candidates}
    rows = []
    for _ in range(args.rounds):
        for label, policy, layout, bf16_cl in candidates:
            result = mixprec.bench(
                workload,
                policies=policy,
                channels_last=layout,
                batch_size=args.batch_size,
                steps=args.steps,
                warmup=args.warmup,
                device="cpu",
            )
            row = next(r for r in result.rows if r.label == label)
            rows.append(row)
            plain_s = plain_loop(args.image_size, args.batch_size, args.steps, args.warmup, bf16_cl)
            per_round[label].append((row.throughput or float("nan"), args.batch_size / plain_s))
    figures = []
    for label, pairs in per_round.items():
        ours = statistics.median(p[0] for p in pairs)
        plain = statistics.median(p[1] for p in pairs)
        figures.append(
            {
                "candidate": label,
                "mixprec_samples_per_s": ours,
                "plain_samples_per_s": plain,
                "ratio_mixprec_over_plain": statistics.median(o / p for o, p in pairs),
                "rounds": pairs,
            }
        )
    for f in figures:
        print(
            f"{f['candidate']:>14}: mixprec {f['mixprec_samples_per_s']:.2f} samples/s, plain loop "
            f"{f['plain_samples_per_s']:.2f} samples/s, "
            f"median per-round ratio {f['ratio_mixprec_over_plain']:.3f}"
        )
    speedups = [
        o_cl / o_fp
        for (o_fp, _), (o_cl, _) in zip(per_round["fp32"], per_round["bf16-mixed+cl"], strict=True)
    ]
    print(f"mixprec: bf16-mixed+cl over strict fp32, median of rounds: {statistics.median(speedups):.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "benchmark": "compare_plain",
                    "command": "python benchmarks/compare_plain.py "
                    + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"),
                    "env": collect("cpu"),
                    "figures": figures,
                    "bf16_cl_speedup_over_fp32": statistics.median(speedups),
                    "bench_rows": [r.to_dict() for r in rows],
                },
                fh,
                indent=2,
            )


if __name__ == "__main__":
    main()
