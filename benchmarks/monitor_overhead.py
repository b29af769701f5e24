"""What the monitor costs at its defaults: the same training loop with and without a
``mixprec.Monitor`` (every=100, no shadow steps), interleaved rounds on the same machine, median of
the per-round ratios of step time. Two models: a launch-bound one (a small MLP at batch 32: the
monitor's per-step work is largest against its step) and ResNet-50 (32 px, batch 8 on a CPU).

    python benchmarks/monitor_overhead.py [--rounds 5] [--steps 200] --out benchmarks/results/cpu-amd-epyc
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.workload.zoo import build_zoo_workload


def mlp() -> mixprec.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return mixprec.Workload(
        model=model,
        make_batch=lambda b, d: (torch.randn(b, 64), torch.randint(0, 10, (b,))),
        loss_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
        name="mlp",
        default_batch_size=32,
    )


MODELS = {
    "mlp (launch-bound)": (mlp, 32),
    "resnet50 (32 px)": (lambda: build_zoo_workload("resnet50", image_size=32), 8),
}


class Loop:
    """One model, policy and optimizer, with or without a monitor, run a few steps at a time."""

    def __init__(self, build, batch: int, policy: str, monitored: bool) -> None:
        self.w = build()
        self.policy = mixprec.get_policy(policy, device="cpu")
        self.model = self.policy.prepare(self.w.model)
        self.optimizer = self.w.make_optimizer(self.model)
        self.batches = [self.w.make_batch(batch, torch.device("cpu")) for _ in range(8)]
        self.monitor = (
            mixprec.Monitor(self.model, self.policy, optimizer=self.optimizer, loss_fn=self.w.loss_fn)
            if monitored
            else None
        )
        self.i = 0

    def run(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps."""
        start = time.perf_counter()
        for _ in range(steps):
            batch = self.batches[self.i % len(self.batches)]
            with self.policy.autocast():
                loss = self.w.loss_fn(self.model, batch)
            self.optimizer.zero_grad(set_to_none=True)
            self.policy.backward(loss)
            self.policy.step(self.optimizer)
            if self.monitor is not None:
                self.monitor.observe(loss, batch)
            self.i += 1
        return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="steps per round and variant (2 sampled)")
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu"))
    args = parser.parse_args()
    results = {}
    for name, (build, batch) in MODELS.items():
        plain, watched = Loop(build, batch, args.policy, False), Loop(build, batch, args.policy, True)
        plain.run(20), watched.run(20)  # warm-up
        ratios, times = [], {"plain": [], "monitor": []}
        for r in range(args.rounds):
            order = (plain, watched) if r % 2 == 0 else (watched, plain)
            t = {id(loop): loop.run(args.steps) for loop in order}
            times["plain"].append(t[id(plain)])
            times["monitor"].append(t[id(watched)])
            ratios.append(t[id(watched)] / t[id(plain)])
        ratio = statistics.median(ratios)
        results[name] = {
            "median_ratio": ratio,
            "ratios": ratios,
            "plain_ms": statistics.median(times["plain"]) * 1e3,
            "monitor_ms": statistics.median(times["monitor"]) * 1e3,
            "findings": [f.to_dict() for f in watched.monitor.findings] if watched.monitor else [],
        }
        print(
            f"{name:22s} step {results[name]['plain_ms']:.2f} ms plain, {results[name]['monitor_ms']:.2f} ms "
            f"monitored: overhead {ratio - 1:+.2%} (rounds: {', '.join(f'{x - 1:+.1%}' for x in ratios)})"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "monitor_overhead.json"
    out.write_text(
        json.dumps(
            {
                "command": "python " + " ".join(sys.argv),
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "policy": args.policy,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
