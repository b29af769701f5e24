"""`mixprec train`: run a workload for N steps under a policy with the precision monitor."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from mixprec.cli.common import (
    Defaults,
    add_workload_arguments,
    positive_int,
    slow_format_warnings,
    workload_from_args,
)
from mixprec.errors import PolicyError, UsageError
from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.train import TrainInterrupted, TrainResult, train
from mixprec.policy import Candidate, canonical_name
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
        "more than 0.15%% of the run)",
    )
    p.add_argument("--shadow-every", type=int, default=0, help="steps between fp32 shadow steps (0: off)")
    p.add_argument(
        "--out", default="mixprec-out/train", help="folder for events.jsonl, train.json, train.png"
    )
    # what --out holds: checked (regular files or absent, the folder writable) before anything runs
    p.set_defaults(run=run, out_files=OUT_FILES)


OUT_FILES = ("events.jsonl", "train.json", "train.png", "skip_batches.json")


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    try:
        policy = canonical_name(args.policy)  # the aliases too: fp16, bf16, 16-mixed, ...
    except PolicyError as exc:
        raise PolicyError(f"--policy: {exc}") from None
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
    skip_list = folder / "skip_batches.json"  # the batches a data spike's withheld update came from
    skip_list.unlink(missing_ok=True)
    config = MonitorConfig(rescue=args.rescue, every=args.every, shadow_every=args.shadow_every)
    try:
        result = train(
            workload,
            Candidate(policy),
            args.steps,
            config=config,
            device=str(defaults.device),
            batch_size=defaults.batch_size(),
            findings=findings,
            skip_list=skip_list,
            progress=_progress_lines(err, policy, defaults, workload),
        )
    except TrainInterrupted as stop:  # Ctrl-C / SIGTERM: the steps done are written whole, then 130/143
        err.print(f"mixprec train: {stop.result.stopped}", soft_wrap=True)
        _write(stop.result, args, defaults, err, plotted=False)
        raise stop.__cause__ or stop from None
    out.print(train_report(result))
    _write(result, args, defaults, err)
    return 0 if result.healthy else 4


# Progress lines per run: one each twentieth of the run (and the last step), so a long run says how
# far it is without flooding a log.
PROGRESS_LINES = 20


def _progress_lines(
    err: Console, policy: str, defaults: Defaults, workload: Any
) -> Callable[[dict[str, Any]], None]:
    """A progress line every twentieth of the run: the step, the loss, the skips, elapsed and ETA;
    at step 0 (the workload validated) a warning if the policy's format is slow here."""
    started = time.perf_counter()
    first: list[float] = []

    def show(event: dict[str, Any]) -> None:
        step, steps = event["step"], event["steps"]
        if step == 0:
            device = str(defaults.device)
            for warning in slow_format_warnings([policy], defaults.framework, workload, device):
                err.print(f"warning: {warning}", highlight=False)
            return
        if step % max(1, steps // PROGRESS_LINES) and step != steps and step != 1:
            return
        now = time.perf_counter()
        if step == 1:
            first.append(now)  # the first step pays warm-up: the ETA is paced by the steps after it
        elapsed = now - started
        paced = (now - first[0]) / (step - 1) if step > 1 and first else None
        eta = _clock(paced * (steps - step)) if paced is not None else "?"
        found = f", {event['findings']} findings" if event["findings"] else ""
        err.print(
            f"step {step}/{steps}: loss {event['loss']:.4g}, {event['skipped']} skipped{found} "
            f"(elapsed {_clock(elapsed)}, eta {eta})",
            highlight=False,
        )

    return show


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}:{secs:02d}"


def _write(
    result: TrainResult, args: argparse.Namespace, defaults: Defaults, err: Console, *, plotted: bool = True
) -> None:
    """train.json (and train.png unless interrupted: plotting takes seconds) into --out; the skip list
    and events.jsonl are written as the run goes."""
    folder = Path(args.out)
    env = defaults.framework.environment(defaults.device)
    err.print(f"wrote {write_json(folder / 'train.json', 'train', env, result.to_dict())}")
    if plotted:
        err.print(f"wrote {plot(folder / 'train.png', result)}")
    for kept in (folder / "skip_batches.json", folder / "events.jsonl"):
        if kept.exists():
            err.print(f"wrote {kept}")
