"""`mixprec demo`: train a small built-in model for a few steps under the best supported policy."""

from __future__ import annotations

import argparse

from rich.console import Console

from mixprec.cli.common import positive_int
from mixprec.demo import run_demo
from mixprec.hardware import detect
from mixprec.policy import get_policy, starting_policy
from mixprec.report.console import demo_report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a small built-in model under the best supported policy")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    p.add_argument("--policy", default=None, help="policy name (default: the best supported one here)")
    p.add_argument("--steps", type=positive_int, default=30)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    info = detect(args.device)
    name = args.policy or starting_policy(info)
    policy = get_policy(name, device=args.device)
    baseline = run_demo(get_policy("fp32", device=args.device), steps=args.steps)
    result = run_demo(policy, steps=args.steps)
    out.print(demo_report(result, baseline, chosen_automatically=args.policy is None))
    return 0
