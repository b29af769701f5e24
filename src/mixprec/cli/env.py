"""`mixprec env`: a copy-pasteable report of versions, capabilities and precision state."""

from __future__ import annotations

import argparse

from rich.console import Console

from mixprec.frameworks import framework_named, framework_names
from mixprec.hardware import detect
from mixprec.hardware.formats import format_speeds
from mixprec.policy import Candidate
from mixprec.policy.support import support_table
from mixprec.report.console import env_report
from mixprec.report.jsonio import write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="versions, device capabilities, precision state, supported policies")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument(
        "--framework",
        choices=framework_names(),
        default="torch",
        help="tensorflow: add TensorFlow's facts",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    framework = framework_named(args.framework)
    env = framework.environment(args.device, full=True)
    info = detect(args.device)
    policies = support_table(info)
    # what the flags call native, measured: a format may have fast matmuls and slow convolutions
    speeds = format_speeds(info) if info.type == "cpu" else {}
    env["format_speeds"] = {key: speed.to_dict() for key, speed in speeds.items()}
    for row in policies:
        speed = speeds.get(Candidate(str(row["policy"])).spec.peak_key)
        why = speed.slow(conv=True) if speed is not None and row["supported"] else None
        if why is not None:
            row["reason"] = f"{row['reason']}; measured here: {why.split(': ', 1)[1]}"
    out.print(env_report(env, policies))
    section = env.get(framework.name)  # a backend's own facts (TensorFlow's), beside torch's
    if isinstance(section, dict):
        out.print(f"{framework.title}:")
        for key, value in section.items():
            out.print(f"  {key}: {value}", highlight=False)
    if args.json:
        path = write_json(args.json, "env", env, {"policies": policies})
        err.print(f"wrote {path}")
    return 0
