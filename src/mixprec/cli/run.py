"""`mixprec run --policy P -- python train.py ...`: the user's script, unchanged, trained under a
candidate (what `tune` recommends, with no edit), with the precision monitor when asked."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from mixprec.cli.common import positive_int
from mixprec.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, UnsupportedError, UsageError
from mixprec.policy import Candidate
from mixprec.policy.candidate import COMPILE_SCOPES, OPTIMIZER_IMPLS
from mixprec.policy.registry import canonical_name

if TYPE_CHECKING:
    from mixprec.frameworks.script.launch import Child


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        usage="mixprec run --policy POLICY [options] -- COMMAND ...",
        help="run your training script unchanged under a policy: mixprec run --policy P -- python train.py",
        description="Everything after '--' is your command, run as it is (your folder, your terminal, "
        "your stdin, your own randomness), with the candidate applied: its precision (autocast, loss "
        "scaling with every gradient read unscaled, *-true casts, the fp32 math mode, fp8/MXFP8/NVFP4 "
        "Linear layers), channels_last, fp32 islands and torch.compile in a plain loop; through the HF "
        "Trainer, Lightning or Accelerate, their own precision switch; the optimizer's implementation "
        "wherever the script builds a torch optimizer. A run whose candidate did not take effect is "
        "stopped (exit 3). Ctrl-C reaches your script as it would without mixprec; a second one stops it.",
    )
    p.add_argument("--policy", required=True, help="the policy to train under (mixprec env lists them)")
    p.add_argument("--channels-last", action="store_true", help="channels_last weights and inputs")
    p.add_argument(
        "--keep-fp32", default="", metavar="MODULES", help="modules kept in fp32 (comma-separated)"
    )
    p.add_argument(
        "--keep-bf16",
        default="",
        metavar="LINEARS",
        help="fp8-*, mxfp8, nvfp4: the precision map, Linear layers (optionally NAME:forward|dgrad|wgrad "
        "under mxfp8/nvfp4) kept in bf16 (comma-separated; what check --fix finds)",
    )
    p.add_argument("--compile", default=None, metavar="MODE", help="torch.compile the model in this mode")
    p.add_argument(
        "--compile-scope",
        choices=COMPILE_SCOPES,
        default=None,
        help="what --compile compiles in a plain loop: the model (default), or the step (the model and "
        "each optimizer's update)",
    )
    p.add_argument(
        "--optimizer",
        default=None,
        metavar="IMPL",
        help=f"build the script's torch optimizers with this implementation ({', '.join(OPTIMIZER_IMPLS)})",
    )
    p.add_argument(
        "--accumulate",
        type=positive_int,
        default=1,
        metavar="K",
        help="K micro-batches per optimizer step (gradient accumulation: the script's batch is the "
        "micro-batch; in its own loop each loss is divided by K and the optimizer, zero_grad, a clip and "
        "the LR scheduler act every K-th iteration; the HF Trainer's gradient_accumulation_steps and "
        "Lightning's accumulate_grad_batches are multiplied by K)",
    )
    p.add_argument(
        "--monitor", action="store_true", help="watch the run with mixprec's precision monitor (events.jsonl)"
    )
    p.add_argument(
        "--rescue", action="store_true", help="let the monitor act on what it finds (implies --monitor)"
    )
    p.add_argument("--every", type=positive_int, default=None, help="the monitor's sampling interval")
    p.add_argument(
        "--out", default="mixprec-out/run", help="folder for run.json and events.jsonl (with --monitor)"
    )
    p.set_defaults(run=run, out_files=("run.json", "events.jsonl"))  # checked before the script starts


def candidate_of(args: argparse.Namespace) -> Candidate:
    keep = tuple(n.strip() for n in args.keep_fp32.split(",") if n.strip())
    mapped = tuple(n.strip() for n in args.keep_bf16.split(",") if n.strip())
    return Candidate(
        canonical_name(args.policy),
        channels_last=args.channels_last,
        keep_fp32=keep,
        keep_bf16=mapped,
        compile=args.compile,
        compile_scope=args.compile_scope,
        optimizer=args.optimizer,
        framework="script",
    )


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mixprec.frameworks import framework_named
    from mixprec.frameworks.script import ScriptWorkload
    from mixprec.frameworks.script.launch import launch
    from mixprec.frameworks.script.messages import Plan
    from mixprec.frameworks.script.waiting import wait_run
    from mixprec.hardware.device import detect

    framework = framework_named("script")
    candidate = framework.validate(candidate_of(args))
    info = detect(framework.resolve_device(None))
    support = framework.support(candidate, info)
    if not support:
        hint = f"; try {support.suggestion}" if support.suggestion else ""
        raise UnsupportedError(f"--policy {candidate.policy} is not supported here: {support.reason}{hint}")
    workload = ScriptWorkload.from_command(args.script)
    for note in workload.launch.notes if workload.launch is not None else workload.notes:
        err.print(f"note: {note}", soft_wrap=True)
    folder = Path(args.out).resolve()  # (the script may change its folder: Hydra does)
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / "run.json"
    for earlier in (record, *folder.glob("run.rank*.json"), *folder.glob("events.rank*.jsonl")):
        earlier.unlink(missing_ok=True)  # never an earlier run's record read as this one's
    observer, observe = None, None
    if args.monitor or args.rescue:
        findings = folder / "events.jsonl"
        findings.write_text("")  # the run's findings, one a line (none: an empty file)
        observer = "mixprec.monitor.script:attach"
        observe = {"rescue": args.rescue, "every": args.every, "findings": str(findings)}
    plan = Plan(
        mode="run",
        candidate=candidate.to_dict(),
        out=str(folder),
        seed=None,  # the script's own randomness: a run meant to sample seeds still does
        observer=observer,
        observe=observe,
        accumulate=args.accumulate,
    )
    child = launch(workload, plan, inherit_output=True)
    assert isinstance(child.process, subprocess.Popen)  # (the user's own run is never forked)
    try:
        code, signals = wait_run(child.process, lambda text: err.print(f"mixprec: {text}"))
    finally:
        child.discard()
        workload.close()
    data = _record_of(record, child)
    if data is not None and data.get("error"):
        raise _error_of(data["error"], code)
    steps = data.get("steps", 0) if data is not None else 0
    if not steps:
        if signals:
            return EXIT_TERMINATED if signals[0] == "SIGTERM" else EXIT_INTERRUPTED
        if code != 0:
            raise UsageError(
                f"the script exited with code {code} before its first optimizer step (its output is above)"
            )
        if data is not None and (data.get("facts") or {}).get("model"):
            raise UsageError(
                "the script built an optimizer but never stepped it: nothing was trained under the candidate"
            )
        raise UsageError(
            "the script ran no optimizer step (mixprec applies a candidate to the model an optimizer "
            "trains): nothing was trained under the candidate"
        )
    assert data is not None  # (a step was recorded)
    framework_name = (data.get("facts") or {}).get("framework", "plain")
    ranks = [data, *_other_ranks(folder, data)]
    world = data.get("world") or 1
    on = f" on {world} ranks" if world > 1 else ""
    on += f", {args.accumulate} micro-batches each" if args.accumulate > 1 else ""
    said = f"mixprec run: {steps} optimizer steps of {candidate.label} ({framework_name}){on}; wrote {record}"
    err.print(said, soft_wrap=True)
    for rank in ranks:
        for finding in rank.get("findings") or []:
            seen = finding.get("evidence", {}).get("rank", rank.get("rank")) if world > 1 else None
            where = f" (rank {seen})" if seen is not None else ""
            if "model" in finding.get("evidence", {}):  # (k-fold's folds: each its own monitor)
                where += f" (model {finding['evidence']['model']})"
            line = f"  step {finding['step']}: {finding['kind']}{where}: {finding['message']}"
            err.print(line, soft_wrap=True)
    if code != 0:
        return code
    return 4 if any(rank.get("healthy") is False for rank in ranks) else 0


def _other_ranks(folder: Path, lead: dict) -> list[dict]:
    """The records of a launch's other ranks (``run.rankN.json``), in rank order."""
    if (lead.get("world") or 1) <= 1:
        return []
    found = []
    for rank in range(1, lead["world"]):
        try:
            found.append(json.loads((folder / f"run.rank{rank}.json").read_text()))
        except (OSError, ValueError):
            continue  # (a rank that wrote none: its findings are gone with it)
    return found


def _record_of(path: Path, child: Child) -> dict | None:
    """This run's record (None: the script wrote none, or another run's is there)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if child.folder is not None and data.get("plan") == str(child.folder / "plan.json") else None


def _error_of(message: str, code: int) -> Exception:
    """The agent's reason for stopping the run, as the error its exit code names."""
    from mixprec.errors import RunStopped

    if code == 3:
        return UnsupportedError(message)
    return RunStopped(message) if code == 4 else UsageError(message)
