"""A plain loop with no precision code at all (an AdamW and, made after it, a CosineAnnealingLR: the
README's own loop has one), and the same loop edited by hand the way the PyTorch AMP recipe says
(``--hand bf16``: torch.autocast around forward and loss; ``--hand fp16``: also a GradScaler,
unscaled before clipping). ``mixprec run --policy P`` on the loop with ``--hand none`` must leave
the weights the hand edit leaves (tests/frameworks/test_script.py).

    python by_hand.py --steps 12 --out weights.pt [--hand none|bf16|fp16] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hand", choices=["none", "bf16", "fp16"], default="none")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(4)]
    data = [(x.to(device), y.to(device)) for x, y in data]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.hand)
    scaler = torch.amp.GradScaler(device.type) if args.hand == "fp16" else None
    for step in range(args.steps):
        x, y = data[step % len(data)]
        ctx = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
