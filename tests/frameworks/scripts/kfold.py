"""k-fold cross-validation as people write it: a new model and optimizer per fold, trained, scored,
let go. ``--nan-at FOLD:STEP`` feeds one NaN batch."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--folds", type=int, default=3)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--nan-at", default="")
args = parser.parse_args()
nan_fold, _, nan_step = args.nan_at.partition(":")

torch.manual_seed(0)
scores = []
for fold in range(args.folds):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
        if args.nan_at and (fold, step) == (int(nan_fold), int(nan_step)):
            x = x * float("nan")
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
        scores.append((model(x).argmax(1) == y).float().mean().item())
print("fold scores", " ".join(f"{s:.3f}" for s in scores))
