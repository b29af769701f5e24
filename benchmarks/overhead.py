"""Overhead of mixprec's Policy over a plain torch.amp training loop.

A plain autocast (+ GradScaler for fp16) loop and the same loop through mixprec train
4 x Linear(1024) at batch 64 (--width, --batch). Rounds are interleaved ABBA (plain, mixprec,
mixprec, plain) so machine drift hits both alike; the figure is the median of the per-round time
ratios. On a GPU this model is launch-bound, so every host-side microsecond mixprec adds per step would show.
Target: mixprec / plain <= 1.02. A control runs in the same rounds: a second plain loop over the
first (plain/plain), the ratio two identical loops show on this machine.

    python benchmarks/overhead.py [--device cuda] [--rounds 15] [--steps 20] [--optimizer adamw]
        [--clip 1.0] [--width 1024] [--batch 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys

import torch
from torch import nn
from torch.utils import benchmark

import mixprec
import mixprec.hardware.environment


def make_model(width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)])


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def plain_step_fn(
    model: nn.Module, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor, opt_name: str, clip
):
    device_type = x.device.type
    model.to(x.device)
    opt = make_optimizer(model, opt_name)
    scaler = torch.amp.GradScaler(device_type) if dtype == torch.float16 else None

    def step() -> None:
        with torch.autocast(device_type, dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def mixprec_step_fn(
    model: nn.Module, policy_name: str, x: torch.Tensor, y: torch.Tensor, opt_name: str, clip
):
    policy = mixprec.get_policy(policy_name, device=x.device)
    model = policy.prepare(model)
    opt = make_optimizer(model, opt_name)

    def step() -> None:
        with policy.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        policy.backward(loss)
        policy.step(opt, clip_grad_norm=clip)
        opt.zero_grad(set_to_none=True)

    return step, policy


def measure(
    policy_name: str,
    rounds: int,
    steps: int,
    device: str,
    opt_name: str = "sgd",
    clip: float | None = None,
    width: int = 1024,
    batch: int = 64,
) -> dict[str, object]:
    dtype = torch.float16 if policy_name.startswith("fp16") else torch.bfloat16
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    base = make_model(width)
    plain = plain_step_fn(copy.deepcopy(base), dtype, x, y, opt_name, clip)
    # The control: a second plain loop, its own copy of the model and optimizer. Two identical loops
    # can time a few percent apart on a CPU (where their tensors landed in memory), so a ratio is
    # only read against the plain/plain ratio measured the same way.
    twin = plain_step_fn(copy.deepcopy(base), dtype, x, y, opt_name, clip)
    ours, policy = mixprec_step_fn(copy.deepcopy(base), policy_name, x, y, opt_name, clip)
    with policy.precision_scope():  # all loops run under the same (strict) fp32 math state
        for fn in (plain, twin, ours):  # warm-up (CUDA: context, cuBLAS handles, kernel selection)
            for _ in range(10):
                fn()
        plain_t, ours_t, plain_c, twin_t = [], [], [], []

        def timed(fn) -> float:
            return benchmark.Timer("f()", globals={"f": fn}).timeit(steps).median

        for _ in range(rounds):  # ABBA twice: a drift within a round hits both sides alike
            a1, b1, b2, a2 = timed(plain), timed(ours), timed(ours), timed(plain)
            plain_t.append((a1 + a2) / 2)
            ours_t.append((b1 + b2) / 2)
            a1, c1, c2, a2 = timed(plain), timed(twin), timed(twin), timed(plain)
            plain_c.append((a1 + a2) / 2)
            twin_t.append((c1 + c2) / 2)
    ratios = [o / p for o, p in zip(ours_t, plain_t, strict=True)]
    control = [t / p for t, p in zip(twin_t, plain_c, strict=True)]
    return {
        "policy": policy_name,
        "plain_step_ms": statistics.median(plain_t) * 1e3,
        "mixprec_step_ms": statistics.median(ours_t) * 1e3,
        "median_ratio": statistics.median(ratios),
        "control_ratio": statistics.median(control),
        "rounds": rounds,
        "steps_per_round": steps,
        "device": device,
        "optimizer": opt_name,
        "clip_grad_norm": clip,
        "width": width,
        "batch": batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policies", default="bf16-mixed,fp16-mixed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (timed with a synchronising timer)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument(
        "--clip", type=float, default=None, help="clip the gradient norm to this (both loops)"
    )
    parser.add_argument("--width", type=int, default=1024, help="the Linear layers' width")
    parser.add_argument(
        "--batch", type=int, default=64, help="a smaller batch shortens the step, so per-step work shows"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = [
        measure(name, args.rounds, args.steps, args.device, args.optimizer, args.clip, args.width, args.batch)
        for name in args.policies.split(",")
    ]
    for r in results:
        print(
            f"{r['policy']:>11}: plain {r['plain_step_ms']:.2f} ms/step, mixprec {r['mixprec_step_ms']:.2f} "
            f"ms/step, median ratio mixprec/plain = {r['median_ratio']:.4f} (control: plain/plain "
            f"{r['control_ratio']:.4f})"
        )
    if args.json:
        env = mixprec.hardware.environment.collect(args.device, full=True)
        command = "python benchmarks/overhead.py " + " ".join(sys.argv[1:])
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"benchmark": "overhead", "command": command, "env": env, "results": results}, f, indent=2
            )


if __name__ == "__main__":
    main()
