"""`mixprec check`: prove a policy trains like fp32, find where it breaks, and fix it."""

from __future__ import annotations

import argparse

from rich.console import Console

from mixprec.checking.check import check, checked_by_all
from mixprec.checking.config import TRAIN_STEPS, CheckConfig
from mixprec.cli.common import (
    CandidateProgress,
    Defaults,
    add_workload_arguments,
    positive_int,
    require_supported,
    workload_from_args,
)
from mixprec.errors import NumericsFailed, NumericsInconclusive, UsageError
from mixprec.measure.config import parse_policies
from mixprec.policy.candidate import EMULATABLE, Candidate
from mixprec.policy.registry import spec_of
from mixprec.report.check import check_report, plot
from mixprec.report.jsonio import write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="train each policy next to fp32 and judge its numerics")
    add_workload_arguments(p)
    p.add_argument("--policies", default="bf16-mixed,fp16-mixed", help="comma-separated policy names")
    p.add_argument("--steps", type=positive_int, default=8, help="training steps compared with fp32")
    p.add_argument(
        "--emulate",
        action="append",
        default=[],
        metavar="FMT",
        help=f"also check an emulated format ({', '.join(EMULATABLE)}); repeatable",
    )
    p.add_argument(
        "--fix",
        action="store_true",
        help="search a keep_fp32 set for failing candidates (for fp8, mxfp8, nvfp4: a precision map)",
    )
    p.add_argument(
        "--keep-fp32",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep the modules matching this name pattern in fp32 under every policy (e.g. a --fix "
        "result, to check it again); repeatable",
    )
    p.add_argument(
        "--keep-bf16",
        action="append",
        default=[],
        metavar="ENTRY",
        help="the low formats' precision map: keep this Linear (a name pattern, optionally with "
        ":forward, :dgrad or :wgrad under mxfp8/nvfp4) in bf16 under fp8-*, mxfp8 and nvfp4 (e.g. a "
        "--fix result, to check it again); repeatable",
    )
    p.add_argument(
        "--train-steps",
        type=positive_int,
        default=TRAIN_STEPS,
        help=f"length of your training run: a layer predicted to overflow within it is at-risk "
        f"(default {TRAIN_STEPS})",
    )
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.set_defaults(run=run)


def check_config(args: argparse.Namespace, defaults: Defaults, policies: list[str]) -> CheckConfig:
    """The command line as a :class:`CheckConfig`: each policy a Candidate with the islands and the
    precision map given (the map is the low formats' own: other policies run no Linear in one)."""
    framework = defaults.framework
    return CheckConfig(
        policies=tuple(
            Candidate(
                p,
                keep_fp32=tuple(args.keep_fp32),
                framework=framework.name,
                keep_bf16=tuple(args.keep_bf16) if spec_of(p).low_format else (),
            )
            for p in policies
        ),
        emulate=tuple(args.emulate),
        steps=args.steps,
        batch_size=defaults.batch_size(),
        device=defaults.device,
        fix=args.fix,
        train_steps=args.train_steps,
    )


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    every = args.policies.strip() == "all"  # (what this device cannot run: a row that says so)
    policies = checked_by_all() if every else [p for p in args.policies.split(",") if p.strip()]
    if not policies and not args.emulate:
        raise UsageError("--policies is empty and no --emulate given: nothing to check.")
    defaults = Defaults(args, "check")
    framework = defaults.framework
    # fp8 on a device without it is still checked: its numerics are predicted here
    require_supported(
        [] if every else parse_policies(policies),
        defaults,
        allowed=lambda cand, info: framework.predictable(cand, info) is not None,
    )
    workload = workload_from_args(args, defaults)
    with CandidateProgress(err, "checking", verbose=args.verbose) as shown:
        result = check(workload, check_config(args, defaults, policies), events=shown.event)
    out.print(check_report(result))
    if args.json:
        env = framework.environment(defaults.device)
        err.print(f"wrote {write_json(args.json, 'check', env, result.to_dict())}")
    if args.plot:
        err.print(f"wrote {plot(args.plot, result)}")
    if result.failed:
        return NumericsFailed.exit_code
    # nothing failed, but the reference did not learn: no pass either (the report says why)
    return NumericsInconclusive.exit_code if result.inconclusive else 0
