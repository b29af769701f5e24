"""Where a paired speedup comes from: the same two training steps timed in one process and in two.

mixprec times each candidate in a process of its own, paired step by step with a strict-fp32
baseline session (measure/paired.py); a plain probe times every variant in one process. Issue 53
saw the two disagree by up to 18% on ResNet-50. This separates the causes with planted pairs:

  A/A    the same strict-fp32 step on both sides: any ratio but 1.00 is the method's, not the
         candidate's. Timed in one process (two model copies) and in two processes (each its own
         copy, driven alternately through a pipe, as mixprec's paired sweep does), each with
         ``--setups`` fresh setups, so a per-process effect shows as a spread between setups.
  A/B    strict fp32 against a candidate (``--candidate``: channels_last, bf16 autocast, ...),
         timed both ways: the speedup the two methods give.

Each under the environment given by ``--env`` (e.g. ``OMP_WAIT_POLICY=PASSIVE``: libgomp's
waiting threads sleep instead of spinning on the cores the running side needs).

    python benchmarks/session_effect.py --model resnet50 --image-size 64 --batch 8 --setups 3
    python benchmarks/session_effect.py ... --env OMP_WAIT_POLICY=PASSIVE --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = r"""
import sys, time, json, torch, torchvision
import torch.nn.functional as F
spec = json.loads(sys.argv[1])
torch.manual_seed(0)

def build(variant):
    model = getattr(torchvision.models, spec["model"])(num_classes=10)
    x = torch.randn(spec["batch"], 3, spec["image_size"], spec["image_size"])
    y = torch.randint(0, 10, (spec["batch"],))
    if "cl" in variant:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    bf16 = "bf16" in variant
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step

steps = {v: build(v) for v in spec["variants"]}
for v, s in steps.items():
    for _ in range(spec["warmup"]):
        s()
print("ready", flush=True)
for line in sys.stdin:
    variant, n = line.split()
    times = []
    for _ in range(int(n)):
        t = time.perf_counter(); steps[variant](); times.append(time.perf_counter() - t)
    print(json.dumps(times), flush=True)
"""


class Worker:
    def __init__(self, spec: dict, variants: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps({**spec, "variants": variants})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def time(self, variant: str, n: int) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{variant} {n}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def paired(sides: list[tuple[Worker, str]], rounds: int, steps: int) -> list[float]:
    """ABBA rounds; each round's ratio: side 0's median step over side 1's (> 1: side 1 faster).
    A side's first step in a round is left out (mixprec does the same with 3+ steps a round)."""
    ratios = []
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        med = {}
        for i in order:
            worker, variant = sides[i]
            med[i] = statistics.median(worker.time(variant, steps + 1)[1:])
        ratios.append(med[0] / med[1])
    return ratios


def setup(spec: dict, a: str, b: str, processes: int, env: dict[str, str], rounds: int, steps: int) -> dict:
    if processes == 1:
        one = Worker(spec, [a, b] if a != b else [a, a + "-copy"], env)
        sides = [(one, a), (one, b if a != b else a + "-copy")]
        workers = [one]
    else:
        workers = [Worker(spec, [a], env), Worker(spec, [b], env)]
        sides = [(workers[0], a), (workers[1], b)]
    started = time.perf_counter()
    ratios = paired(sides, rounds, steps)
    for w in workers:
        w.close()
    return {"median": statistics.median(ratios), "ratios": ratios, "seconds": time.perf_counter() - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--candidate", default="fp32-cl", help="the A/B candidate: fp32-cl, bf16, bf16-cl")
    p.add_argument("--setups", type=int, default=3)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per side and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for every worker")
    p.add_argument("--only", choices=("A/A", "A/B"), help="run one of the two comparisons")
    p.add_argument("--json")
    args = p.parse_args()
    env = dict(e.split("=", 1) for e in args.env)
    spec = {"model": args.model, "image_size": args.image_size, "batch": args.batch, "warmup": args.warmup}
    out: dict = {"spec": spec, "env": env, "cpus": os.cpu_count(), "load_start": os.getloadavg()[0]}
    for name, (a, b) in {"A/A": ("fp32", "fp32"), "A/B": ("fp32", args.candidate)}.items():
        if args.only and name != args.only:
            continue
        for processes in (1, 2):
            runs = [setup(spec, a, b, processes, env, args.rounds, args.steps) for _ in range(args.setups)]
            medians = [r["median"] for r in runs]
            key = f"{name} {processes} process{'es' if processes > 1 else ''}"
            out[key] = runs
            shown = ", ".join(f"{m:.3f}" for m in medians)
            print(f"{key:18s} per setup: {shown}  (fp32 / other)", flush=True)
    out["load_end"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
