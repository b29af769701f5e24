"""Does the speedup itself move? One process, minutes of paired rounds, an A/A control beside.

Issue 53 asks tune, bench and a plain probe, run one after another, to agree within 10%. This
asks whether the quantity they measure holds still for the minutes between them. Three steps
live in one process: strict fp32 (A), a second copy of it (A'), and the candidate (B). Every
round times all three, in a rotating order, and gives two ratios: A/A' (the method's own
noise: any drift in it is the method's) and A/B (the speedup). Their medians over consecutive
windows of ``--window`` seconds (about what one command spends on its pick) then show whether
the speedup moves by more than the method does.

    python benchmarks/speedup_drift.py --minutes 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision

RATIOS = ("A/A'", "A/B")


def build(model_name: str, image_size: int, batch: int, bf16: bool, channels_last: bool):
    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(num_classes=10)
    x = torch.randn(batch, 3, image_size, image_size)
    y = torch.randint(0, 10, (batch,))
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def timed(step, n: int) -> float:
    """The median of n steps after one left out (a side's first step in a round is slower)."""
    step()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def windows(rounds: list[dict], key: str, seconds: float) -> list[float]:
    """The median of ``key`` over consecutive windows of the given length (the last, if short, dropped)."""
    out, current, start = [], [], rounds[0]["t"]
    for r in rounds:
        if r["t"] - start >= seconds:
            out.append(statistics.median(current))
            current, start = [], r["t"]
        current.append(r[key])
    return out


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1 if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--candidate", default="bf16-cl", choices=("bf16", "bf16-cl", "fp32-cl"))
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--window", type=float, default=60, help="seconds per window median")
    p.add_argument("--steps", type=int, default=2, help="timed steps per side and round")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shape = (args.model, args.image_size, args.batch)
    sides = {
        "A": build(*shape, bf16=False, channels_last=False),
        "A'": build(*shape, bf16=False, channels_last=False),
        "B": build(*shape, bf16="bf16" in args.candidate, channels_last="cl" in args.candidate),
    }
    for step in sides.values():
        step()
    orders = [("A", "A'", "B"), ("B", "A", "A'"), ("A'", "B", "A")]
    rounds: list[dict] = []
    began = time.perf_counter()
    while time.perf_counter() - began < args.minutes * 60:
        order = orders[len(rounds) % len(orders)]
        t = {name: timed(sides[name], args.steps) for name in order}
        rounds.append(
            {"t": time.perf_counter() - began, "A/A'": t["A"] / t["A'"], "A/B": t["A"] / t["B"], **t}
        )
        last = rounds[-1]
        print(f"{last['t']:6.0f} s  " + "  ".join(f"{k} {last[k]:.3f}" for k in RATIOS), flush=True)
    summary = {}
    for key in RATIOS:
        medians = windows(rounds, key, args.window)
        summary[key] = {
            "window_medians": medians,
            "spread": spread(medians),
            "median": statistics.median(r[key] for r in rounds),
        }
        shown = ", ".join(f"{m:.3f}" for m in medians)
        print(f"{key:5s} {args.window:.0f} s windows: {shown}  (max/min - 1 = {summary[key]['spread']:.1%})")
    if args.json:
        out = {
            "argv": vars(args),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "summary": summary,
            "rounds": rounds,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
