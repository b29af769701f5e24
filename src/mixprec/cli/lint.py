"""`mixprec lint`: tensor-core-unfriendly shapes and precision mistakes, optionally measured."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from mixprec.cli.common import (
    Defaults,
    add_workload_arguments,
    positive_int,
    sweep_progress,
    workload_from_args,
)
from mixprec.errors import UsageError
from mixprec.frameworks import framework_named
from mixprec.hardware import environment
from mixprec.linting import TARGETS, parse_rule_ids, run_lint
from mixprec.measure.lint_gains import measure_findings
from mixprec.report.jsonio import write_json
from mixprec.report.lint import lint_report, rules_table

# Exit code of --strict when a finding has error severity (linters' convention).
STRICT_EXIT = 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lint",
        help="find tensor-core-unfriendly shapes and precision mistakes (rules with stable ids)",
        description=(
            "Trace one forward pass of the workload's real batch and report shapes that keep "
            "convolutions and matmuls off tensor cores, memory-format and precision mistakes. "
            "On a CPU the tensor-core rules report at info; --target cuda judges them for a GPU."
        ),
    )
    add_workload_arguments(p, verbose=False)
    p.add_argument("--policy", help="policy to judge against (default: the best default for the device)")
    p.add_argument(
        "--channels-last",
        choices=("on", "off"),
        help="judge the policy with channels_last on/off (default: off)",
    )
    p.add_argument(
        "--target",
        choices=TARGETS,
        help="hardware the tensor-core rules judge (default: the device; on cpu they report at info)",
    )
    p.add_argument("--ignore", metavar="ID,...", help="comma-separated rule ids (or names) to silence")
    p.add_argument(
        "--strict", action="store_true", help=f"exit {STRICT_EXIT} when a finding has error severity"
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="build the mechanical fixes, time layer and training step before/after, rank by gain",
    )
    p.add_argument(
        "--steps", type=positive_int, help="with --measure: timed training steps per variant (at least)"
    )
    p.add_argument("--json", metavar="FILE", help="also write the findings as JSON")
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="one row per finding, with each rule's rationale and source",
    )
    p.add_argument("--list-rules", action="store_true", help="list the rules and exit")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.list_rules:
        out.print(rules_table(verbose=args.verbose))
        return 0
    framework = framework_named(args.framework)
    if not framework.linter:
        raise UsageError(
            f"lint has no rules for {framework.title} models (--framework {args.framework}): its rules read "
            f"PyTorch modules; drop --framework, or use 'mixprec check --framework {args.framework}'."
        )
    ignore = parse_rule_ids(args.ignore)  # a typo fails before the model is built
    if args.steps and not args.measure:
        raise UsageError("--steps applies to --measure; add --measure or drop --steps.")
    workload = workload_from_args(args, Defaults(args, "lint"))
    channels_last = None if args.channels_last is None else args.channels_last == "on"
    result = run_lint(
        workload,
        args.policy,
        device=args.device,
        batch_size=args.batch_size,
        ignore=ignore,
        target=args.target,
        channels_last=channels_last,
    )
    if args.measure:
        with sweep_progress(err) as bar:
            task = bar.add_task("measuring", total=None)

            def progress(event: dict[str, Any]) -> None:
                bar.update(task, total=event["count"], completed=event["index"], description=event["what"])

            measure_findings(workload, result, steps=args.steps, progress=progress)
    out.print(lint_report(result, verbose=args.verbose))
    if args.json:
        device = result.policy_obj.device if result.policy_obj is not None else args.device
        path = write_json(args.json, "lint", environment.collect(device), result.to_dict())
        err.print(f"wrote {path}")
    return STRICT_EXIT if args.strict and result.has_errors else 0
