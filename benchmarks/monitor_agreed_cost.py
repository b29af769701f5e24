"""What agreeing the monitor's decisions across data-parallel ranks costs: DDP on 2 gloo ranks on
the CPU, the same loop with and without a Monitor (whose pre-step hook all-reduces one flag per rank
every step), in alternating blocks of steps in the same processes; the median step time of each and
the monitor's share of the step.

    python benchmarks/monitor_agreed_cost.py [--hidden 256] [--blocks 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mixprec
from mixprec.monitor import Monitor

WARM = 30  # the first steps of each block are left out: a new Monitor's warm-up learns the loss level


def _rank(rank: int, world: int, store: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # fmt: skip
    torch.manual_seed(0)
    hidden = args["hidden"]
    model = nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )
    policy = mixprec.get_policy("bf16-mixed", device="cpu")
    ddp = DistributedDataParallel(policy.prepare(model))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]).float(), batch[1])

    def block(monitor: Monitor | None, steps: int, bare_all_reduce: bool = False) -> list[float]:
        times = []
        for _ in range(steps):
            x, y = torch.randn(32, 64), torch.randn(32, 1)
            start = time.perf_counter()
            with policy.autocast():
                loss = loss_fn(ddp, (x, y))
            optimizer.zero_grad()
            policy.backward(loss)
            if monitor is not None:
                monitor.before_step(loss, (x, y))
            if bare_all_reduce:  # what the agreement's collective alone costs
                dist.all_reduce(torch.zeros(world, dtype=torch.int32))
            policy.step(optimizer)
            if monitor is not None:
                monitor.observe(loss, (x, y))
            times.append(time.perf_counter() - start)
        return times

    block(None, 20)  # warm-up
    plain, watched, collective = [], [], []
    for _ in range(args["blocks"]):
        plain += block(None, args["steps"])[WARM:]
        collective += block(None, args["steps"], bare_all_reduce=True)[WARM:]
        monitor = Monitor(ddp, policy, optimizer=optimizer, loss_fn=loss_fn, rescue=True)
        watched += block(monitor, args["steps"])[WARM:]  # (past the detectors' own warm-up)
        monitor.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "plain_ms": statistics.median(plain) * 1e3,
                    "monitored_ms": statistics.median(watched) * 1e3,
                    "all_reduce_only_ms": statistics.median(collective) * 1e3,
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--json")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), vars(args), out), nprocs=2)
        with open(out) as f:
            result = json.load(f)
    result["share"] = result["monitored_ms"] / result["plain_ms"] - 1
    result.update(hidden=args.hidden, world=2, backend="gloo", load=os.getloadavg()[0])
    print(f"2 gloo ranks, hidden {args.hidden}: plain {result['plain_ms']:.3f} ms/step, monitored "
          f"{result['monitored_ms']:.3f} ms/step: +{result['share']:.1%}; the bare all-reduce alone "
          f"{result['all_reduce_only_ms']:.3f} ms/step")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
