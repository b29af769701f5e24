"""A DeepSpeed loop as people write them for the ``deepspeed`` launcher."""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--weights", default=None)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 1, generator=g) / 4
    x = torch.randn(4096, 16, generator=g)
    data = TensorDataset(x, x @ teacher + 0.01 * torch.randn(4096, 1, generator=g))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
    }
    engine, _, loader, _ = deepspeed.initialize(model=model, optimizer=opt, training_data=data, config=config)
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            loss = F.mse_loss(engine(xb), yb)
            engine.backward(loss)
            engine.step()
            step += 1
            if engine.global_rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
            if step == args.steps:
                break
    if args.weights:
        os.makedirs(args.weights, exist_ok=True)
        torch.save(engine.module.state_dict(), os.path.join(args.weights, f"rank{engine.global_rank}.pt"))
    print(f"world {engine.world_size}", flush=True)


if __name__ == "__main__":
    main()
