"""A script that does to its folder what training scripts do: reads its config and data by relative
path, resumes from and saves `ckpt.pt` there, appends to its log, makes a run folder inside an
existing one, removes a stale file and saves next to itself through its own absolute path.

    python own_files.py --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    config = json.loads(Path("config.json").read_text())  # relative: the folder it is started in
    data = torch.load("data/points.pt")
    torch.manual_seed(0)
    model = nn.Linear(config["width"], 1)
    if os.path.exists("ckpt.pt"):
        model.load_state_dict(torch.load("ckpt.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    x, y = data["x"], data["y"]
    for step in range(args.steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with open("train.log", "a") as log:
            log.write(f"step {step} loss {loss.item():.4f}\n")
    torch.save(model.state_dict(), "ckpt.pt")
    os.makedirs("runs/latest", exist_ok=True)
    torch.save(model.state_dict(), "runs/latest/model.pt")
    Path("runs/notes.txt").write_text("overwritten\n")
    if os.path.exists("stale.txt"):
        os.remove("stale.txt")
    torch.save(model.state_dict(), Path(__file__).resolve().parent / "beside.pt")


if __name__ == "__main__":
    main()
