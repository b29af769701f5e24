"""Training scripts written the way people write them, generated from a :class:`Shape`: the LR
scheduler, the clip path, the backward path, gradient accumulation, a model trained in eval mode,
called part by part or built in parts (a body and a head, each its own variable), two optimizers
stepped after one backward, activation checkpointing (the body, the model's first computation, not
reentrant; the head reentrant, torch's default), and the script's own AMP.

Each shape renders two scripts: the script as its author wrote it (``render(shape)``: with its own
AMP switch where it has one, with no precision code at all where it has none) and the same script
edited by hand the way the PyTorch AMP recipe says (``render(shape, hand=True)``, run with ``--amp
bf16|fp16``): autocast around forward and loss, a GradScaler whose ``unscale_`` comes before the
clip, ``scaler.step`` for each optimizer and one ``scaler.update()`` a step. ``mixprec run --policy
P`` over the first must train exactly as the second with ``--amp P``'s format.

Both print ``loss STEP VALUE`` (the step's loss: the sum of its micro-batches' losses, as backward
saw them) and save the final weights to ``--out``.
"""

from __future__ import annotations

import itertools
import random
import textwrap
from dataclasses import asdict, dataclass, fields

AXES: dict[str, tuple[str, ...]] = {
    "scheduler": ("none", "cosine", "lambda", "onecycle"),
    "clip": ("none", "norm", "total_norm", "value", "by_hand"),
    "backward": ("loss", "autograd", "per_sample"),
    "accumulation": ("1", "2"),
    "mode": ("train", "eval"),
    "call": ("root", "parts", "split"),
    "optimizers": ("one", "two"),
    "checkpoint": ("none", "body", "head"),
    "own_amp": ("none", "bf16", "fp16"),
}
STEPS = 6


@dataclass(frozen=True)
class Shape:
    scheduler: str
    clip: str
    backward: str
    accumulation: str
    mode: str
    call: str
    optimizers: str
    checkpoint: str
    own_amp: str

    def __str__(self) -> str:
        return "-".join(f"{k[:3]}={v}" for k, v in asdict(self).items())


def shapes(n: int, seed: int = 51) -> list[Shape]:
    """``n`` shapes: first a greedy pairwise cover (every pair of values of two axes appears in some
    shape), then random ones, all drawn from a fixed seed (the same on every run)."""
    rng = random.Random(seed)
    names = [f.name for f in fields(Shape)]
    every = [dict(zip(names, values, strict=True)) for values in itertools.product(*AXES.values())]
    uncovered = {
        ((a, va), (b, vb)) for a, b in itertools.combinations(names, 2) for va in AXES[a] for vb in AXES[b]
    }
    chosen: list[Shape] = []
    pairs = list(itertools.combinations(names, 2))
    while uncovered and len(chosen) < n:
        sample = rng.sample(every, 200)
        best = max(
            sample, key=lambda s, todo=uncovered: sum(((a, s[a]), (b, s[b])) in todo for a, b in pairs)
        )
        uncovered -= {((a, best[a]), (b, best[b])) for a, b in itertools.combinations(names, 2)}
        chosen.append(Shape(**best))
    while len(chosen) < n:
        chosen.append(Shape(**rng.choice(every)))
    return chosen


def render(shape: Shape, *, hand: bool = False) -> str:
    """The script's source (module docstring); ``hand``: the AMP recipe's edit of it."""
    amp = hand or shape.own_amp != "none"
    accum = int(shape.accumulation)
    frozen = ".eval()  # frozen BatchNorm: trained in eval mode" if shape.mode == "eval" else ""
    model = f"""
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU())
                self.head = nn.Linear(32, 4)

            def forward(self, x):
                return {_call(shape, "self.")}

        torch.manual_seed(0)
        model = Net(){frozen}
        """
    parameters = "model.parameters()"
    if shape.call == "split":  # no module holds both: the script trains its two variables
        model = f"""
            torch.manual_seed(0)
            body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU()){frozen}
            head = nn.Linear(32, 4)
            """
        parameters = "[*body.parameters(), *head.parameters()]"
    if shape.optimizers == "one":
        optimizers = f"opts = [torch.optim.AdamW({parameters}, lr=1e-2)]"
    else:  # the Muon/AdamW split: matrices and vectors, two optimizers after one backward
        optimizers = f"""
            matrices = [p for p in {parameters} if p.dim() == 2]
            vectors = [p for p in {parameters} if p.dim() < 2]
            opts = [torch.optim.SGD(matrices, lr=0.05, momentum=0.9), torch.optim.AdamW(vectors, lr=1e-2)]
            """
    scheduler = {
        "none": "sched = None",
        "cosine": f"sched = torch.optim.lr_scheduler.CosineAnnealingLR(opts[0], T_max={STEPS})",
        "lambda": "sched = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda s: min(1.0, (s + 1) / 3))",
        "onecycle": f"sched = torch.optim.lr_scheduler.OneCycleLR(opts[0], max_lr=0.02, total_steps={STEPS})",
    }[shape.scheduler]
    forward = {"root": "model(x)", "parts": _call(shape, "model."), "split": _call(shape, "")}[shape.call]
    scale = (lambda t: f"scaler.scale({t})") if amp else (lambda t: t)
    if shape.backward == "loss":
        backward = f"{scale('loss')}.backward()"
        counted = "loss"
    elif shape.backward == "autograd":
        backward = f"torch.autograd.backward({scale('loss')})"
        counted = "loss"
    else:  # per-sample losses and their weights
        backward = (
            f"{scale('per_sample')}.backward(torch.full_like(per_sample, 1 / (len(per_sample) * {accum})))"
        )
        counted = f"(per_sample.detach().float() * (1 / (len(per_sample) * {accum}))).sum()"
    clip = {
        "none": "",
        "norm": f"torch.nn.utils.clip_grad_norm_({parameters}, 0.5)",
        "total_norm": f"""
            params = [p for p in {parameters} if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            torch.nn.utils.clip_grads_with_norm_(params, 0.5, norm)
            """,
        "value": f"torch.nn.utils.clip_grad_value_({parameters}, 0.05)",
        "by_hand": f"""
            grads = [p.grad for p in {parameters} if p.grad is not None]
            norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads))
            for grad in grads:
                grad.mul_(min(1.0, 0.5 / (float(norm) + 1e-6)))
            """,
    }[shape.clip]
    if amp:
        precision = """
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
            scaler = torch.amp.GradScaler("cpu", enabled=args.amp == "fp16")
            ctx = lambda: torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
            """
        unscale = "for opt in opts:\n    scaler.unscale_(opt)" if shape.clip != "none" else ""
        step = "for opt in opts:\n    scaler.step(opt)\nscaler.update()"
        enter = "with ctx():"
    else:
        precision, unscale, enter = "", "", "if True:"
        step = "for opt in opts:\n    opt.step()"
    body = f"""
        total = 0.0
        for micro in range({accum}):
            x, y = data[(step * {accum} + micro) % len(data)]
            {enter}
                per_sample = F.cross_entropy({forward}, y, reduction="none")
                loss = per_sample.mean() / {accum}
            {backward}
            total += float({counted})
        {_indent(unscale, 8)}
        {_indent(clip, 8)}
        {_indent(step, 8)}
        if sched is not None:
            sched.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        print(f"loss {{step}} {{total!r}}")
        """
    saved = "nn.ModuleDict(dict(body=body, head=head))" if shape.call == "split" else "model"  # (Net's keys)
    source = f"""
        import argparse

        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        parser = argparse.ArgumentParser()
        parser.add_argument("--amp", default="{shape.own_amp}")
        parser.add_argument("--steps", type=int, default={STEPS})
        parser.add_argument("--out", required=True)
        args = parser.parse_args()
        {_indent(model, 8)}
        {_indent(optimizers, 8)}
        {scheduler}
        {_indent(precision, 8)}
        g = torch.Generator().manual_seed(1)
        draw = lambda: (2 * torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g))
        data = [draw() for _ in range(5)]
        for step in range(args.steps):
            {_indent(body, 12)}
        torch.save({saved}.state_dict(), args.out)
        """
    return textwrap.dedent(source)


def _call(shape: Shape, owner: str) -> str:
    """The model's computation on ``x``, its parts held by ``owner`` (``self.``, ``model.``, none),
    with the shape's checkpoint."""
    body, head = f"{owner}body", f"{owner}head"
    return {
        "none": f"{head}({body}(x))",
        "body": f"{head}(checkpoint({body}, x, use_reentrant=False))",
        "head": f"checkpoint({head}, {body}(x), use_reentrant=True)",
    }[shape.checkpoint]


def _indent(block: str, spaces: int) -> str:
    """``block`` (dedented) with its lines after the first indented by ``spaces``, to sit in the template."""
    lines = textwrap.dedent(block).strip().splitlines() or [""]
    return ("\n" + " " * spaces).join(lines)
