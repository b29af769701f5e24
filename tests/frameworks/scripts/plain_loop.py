"""A nanoGPT-style training script, written the way people write them: a small causal transformer,
a DataLoader over a token file made on the fly, AdamW with decay/no-decay parameter groups,
linear warm-up then cosine learning rate, gradient clipping, its own --steps and --device.

    python plain_loop.py --steps 200 [--device cpu] [--amp none|bf16|fp16] [--out weights.pt]

``--amp bf16|fp16`` is the script's own precision code (torch.autocast + GradScaler, nanoGPT's
``ctx`` and ``scaler``); ``--out`` saves the final weights (the tests compare them)."""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, BLOCK = 512, 64


class Tokens(Dataset):
    """Sequences from a fixed random bigram table: learnable, and the same every run."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        table = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 3, dim=-1)
        seqs = torch.empty(n, BLOCK + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
        cdf = table.cumsum(-1)  # (inverse-CDF sampling: 25x faster here than multinomial per step)
        for t in range(BLOCK):
            u = torch.rand(n, 1, generator=g)
            seqs[:, t + 1] = torch.searchsorted(cdf[seqs[:, t]], u).squeeze(1).clamp_(max=VOCAB - 1)
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seqs[i, :-1], self.seqs[i, 1:]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, d: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(BLOCK, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def lr_at(step: int, steps: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return base * 0.1 + 0.5 * (base - base * 0.1) * (1 + math.cos(math.pi * progress))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT(args.d_model, args.layers).to(args.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    ctx = torch.autocast(args.device, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(args.device, enabled=args.amp == "fp16")
    loader = DataLoader(Tokens(4096), batch_size=args.batch_size, shuffle=True, drop_last=True)

    step = 0
    while step < args.steps:
        for x, y in loader:
            x, y = x.to(args.device), y.to(args.device)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr, warmup=max(1, args.steps // 10))
            with ctx:
                _, loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                print(f"step {step}: loss {loss.item():.4f}")
            step += 1
            if step >= args.steps:
                break
    if args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
