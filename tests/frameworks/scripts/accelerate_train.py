"""An Accelerate loop as people write them for ``accelerate launch``: ``Accelerator()``, ``prepare``,
``accelerator.backward``, AdamW, no precision code of its own (``accelerate launch --mixed_precision``
or the config file sets it). On the CPU, ``Accelerator(cpu=True)``: the processes of an ``accelerate
launch --multi_gpu`` join one gloo group only where the Accelerator is told to use the CPU.

    accelerate launch [--multi_gpu --num_processes 2] accelerate_train.py --steps 40 [--weights out]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--weights", default=None)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 1, generator=g) / 4
    x = torch.randn(4096, 16, generator=g)
    data = TensorDataset(x, x @ teacher + 0.01 * torch.randn(4096, 1, generator=g))
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            with accelerator.autocast():
                loss = F.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            step += 1
            if accelerator.is_main_process and step % 10 == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
            if step == args.steps:
                break
    if args.weights:
        os.makedirs(args.weights, exist_ok=True)
        state = accelerator.unwrap_model(model).state_dict()
        torch.save(state, os.path.join(args.weights, f"rank{accelerator.process_index}.pt"))
    print(f"world {accelerator.num_processes} {accelerator.distributed_type}", flush=True)


if __name__ == "__main__":
    main()
