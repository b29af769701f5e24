"""A plain DDP script as people write them for ``torchrun``: gloo on the CPU (NCCL with ``--device
cuda``, a GPU per rank), a DistributedSampler
over a synthetic regression set, AdamW, no precision code. ``--bad-rank R --bad-at S``: rank R's
targets are 1000x too large at step S (one bad shard). ``--weights DIR``: each rank saves its final
weights there (``rank{N}.pt``), so a test can compare the replicas.

    torchrun --nproc_per_node 2 ddp_train.py --steps 120 [--bad-rank 1 --bad-at 80] [--weights out]
        [--device cuda] [--width 1024 --hidden 2 --batch 256 --lr 1e-3]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bad-rank", type=int, default=-1)
    parser.add_argument("--bad-at", type=int, default=-1)
    parser.add_argument("--weights", default=None)
    # (a plain launch's leave: skip the interpreter's shutdown once everything is written; see the end)
    parser.add_argument("--leave-at-once", action="store_true")
    parser.add_argument("--device", default="cpu")
    # --width W --hidden N: N more W-wide layers, a step that computes enough for a format to matter
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)  # (1e-2 makes the wide net's fp32 diverge)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 1, generator=g) / 4  # (targets of unit scale: learnt from the first steps)
    x = torch.randn(4096, 16, generator=g)
    data = TensorDataset(x, x @ teacher + 0.01 * torch.randn(4096, 1, generator=g))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    w = args.width
    layers = [nn.Linear(16, w), nn.ReLU()]
    for _ in range(args.hidden):
        layers += [nn.Linear(w, w), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(w, 1)).to(device)
    model = DistributedDataParallel(net, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            if step == args.bad_at and rank == args.bad_rank:
                yb = yb * 1000.0
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    # (DDP's replicas are equal: rank 0's loss is the job's. An all_reduce of a tensor made here as the
    # script's last collective made torch 2.14.1 abort at exit in ~1 run in 12 on a 2-core machine:
    # gloo's worker thread frees the finished work, and with it the tensor's Python object, after the
    # interpreter began to shut down, "terminate called without an active exception".)
    if rank == 0:
        with torch.no_grad():
            final = F.mse_loss(model.module(x[:512].to(device)), data.tensors[1][:512].to(device))
        print(f"final loss {final.item():.6f} world {world}")
    if args.weights:
        os.makedirs(args.weights, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.weights, f"rank{rank}.pt"))
    dist.destroy_process_group()
    if args.leave_at_once:
        # Outside `mixprec run` nothing waits for gloo's worker threads at exit: in torch 2.14.1 one can
        # let go of DDP's last gradient all_reduce after the interpreter began to shut down, which
        # aborts the rank (SIGABRT, "terminate called without an active exception"; once in CI, in a
        # plain torchrun of this script). Under `mixprec run` the agent waits for them at atexit.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
