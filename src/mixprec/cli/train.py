"""`mixprec train`: run a workload for N steps under a policy with the precision monitor."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from rich.console import Console

from mixprec.cli.common import Defaults, add_workload_arguments, positive_int, workload_from_args
from mixprec.errors import UsageError
from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.train import train
from mixprec.policy import Candidate
from mixprec.policy.registry import POLICIES
from mixprec.report.jsonio import write_json
from mixprec.report.train import plot, train_report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a workload under a policy with the precision monitor")
    add_workload_arguments(p, verbose=False)
    p.add_argument("--policy", default="bf16-mixed", help="the policy to train under")
    p.add_argument("--steps", type=positive_int, default=1000, help="training steps")
    p.add_argument("--rescue", action="store_true", help="let the monitor act on what it finds")
    p.add_argument(
        "--every",
        type=positive_int,
        default=None,
        help="steps between sampled steps (default: 100, or less often where sampling would cost "
        "more than 0.25%% of the run)",
    )
    p.add_argument("--shadow-every", type=int, default=0, help="steps between fp32 shadow steps (0: off)")
    p.add_argument(
        "--out", default="mixprec-out/train", help="folder for events.jsonl, train.json, train.png"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.policy not in POLICIES:
        raise UsageError(f"unknown --policy {args.policy!r}; valid: {', '.join(POLICIES)}.")
    if args.shadow_every < 0:
        raise UsageError(f"--shadow-every must be >= 0, got {args.shadow_every}.")
    defaults = Defaults(args, "check")
    if defaults.framework.name != "torch":
        raise UsageError("mixprec train runs torch workloads; the Keras monitor is not there yet.")
    workload = workload_from_args(args, defaults)
    # the findings are printed once, below, not also by the monitor's logger
    logging.getLogger("mixprec.monitor").addHandler(logging.NullHandler())
    logging.getLogger("mixprec.monitor").propagate = False
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    findings = folder / "events.jsonl"  # the monitor's findings, one JSON line each
    findings.unlink(missing_ok=True)
    config = MonitorConfig(rescue=args.rescue, every=args.every, shadow_every=args.shadow_every)
    result = train(
        workload,
        Candidate(args.policy),
        args.steps,
        config=config,
        device=str(defaults.device),
        batch_size=defaults.batch_size(),
        findings=findings,
    )
    out.print(train_report(result))
    env = defaults.framework.environment(defaults.device)
    err.print(f"wrote {write_json(folder / 'train.json', 'train', env, result.to_dict())}")
    err.print(f"wrote {plot(folder / 'train.png', result)}")
    return 0 if result.healthy else 4
