"""`bench`, `check`, `tune` and `env` with ``--framework tensorflow``: Keras workloads
(:mod:`mixprec.keras`) through the same tables and reports as torch ones."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from mixprec.cli.common import sweep_progress
from mixprec.errors import UsageError
from mixprec.report.jsonio import write_json

# resnet50 at 64 px and batch 16: about 0.7 s per fp32 step on a 2-core CPU, so the default sweep
# and `tune` (tf.function tracing costs ~15 s per candidate) end within a few minutes.
CPU_DEFAULTS: dict[str, Any] = {"image_size": 64, "batch_size": 16, "steps": 4, "warmup": 1, "min_time": 1.0}
CUDA_DEFAULTS: dict[str, Any] = {
    "image_size": 224,
    "batch_size": 256,
    "steps": 20,
    "warmup": 5,
    "min_time": 2.0,
}
_CNNS = ("resnet50", "vgg19", "densenet121")


def _workload(args: argparse.Namespace, defaults: dict[str, Any]) -> Any:
    from mixprec.keras import load_keras_workload

    for torch_only in ("seq_len",):
        if getattr(args, torch_only, None):
            raise UsageError(f"--{torch_only.replace('_', '-')} has no Keras zoo model; drop it.")
    target = args.workload or args.model or "resnet50"
    sizes = {}
    if args.image_size:
        sizes["image_size"] = args.image_size
    elif target in _CNNS:
        sizes["image_size"] = defaults["image_size"]
    return load_keras_workload(target, **sizes)


def _defaults(device: str | None) -> tuple[str, dict[str, Any]]:
    from mixprec.keras import backend

    dev = device or backend.default_device()
    return dev, CUDA_DEFAULTS if dev.startswith("cuda") else CPU_DEFAULTS


def _batch_size(args: argparse.Namespace, defaults: dict[str, Any]) -> int | None:
    is_cnn = not args.workload and (args.model or "resnet50") in _CNNS
    return args.batch_size or (defaults["batch_size"] if is_cnn else None)


def run_bench(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mixprec.keras.sweep import bench
    from mixprec.measure.results import write_csv
    from mixprec.report.bench import bench_table, error_tracebacks, plot, write_markdown

    if args.nproc != 1:
        raise UsageError("--nproc (DDP ranks) is torch only; drop it with --framework tensorflow.")
    if args.channels_last not in ("off", "both"):
        raise UsageError("--channels-last on does not apply to Keras (NHWC already); drop it.")
    device, defaults = _defaults(args.device)
    workload = _workload(args, defaults)
    jsonl = Path(args.json).with_suffix(".jsonl") if args.json else None
    with sweep_progress(err) as bar:
        task = bar.add_task("starting", total=None)

        def progress(event: dict[str, Any]) -> None:
            if event["event"] == "candidate":
                bar.update(task, total=event["count"], completed=event["index"], description=event["label"])
            elif event["event"] == "row":
                row = event["row"]
                bar.update(task, completed=event["index"] + 1)
                figure = f"{row.throughput:.1f} samples/s" if row.throughput else row.reason
                bar.console.print(f"{row.label}: {row.status} {figure}", highlight=False)

        result = bench(
            workload,
            policies=args.policies,
            xla=args.xla,
            batch_size=_batch_size(args, defaults),
            steps=args.steps or defaults["steps"],
            warmup=args.warmup or defaults["warmup"],
            min_time_s=defaults["min_time"] if args.min_time is None else args.min_time,
            device=device,
            jsonl=jsonl,
            resume=args.resume,
            isolate=False if args.in_process else None,
            prune_factor=args.prune_factor,
            progress=progress,
        )
    out.print(bench_table(result))
    if getattr(args, "debug", False) and error_tracebacks(result):
        err.print(error_tracebacks(result), highlight=False, markup=False)
    written = []
    if args.json:
        written.append(write_json(args.json, "bench", result.env, result.to_dict()))
    if args.csv:
        written.append(write_csv(args.csv, result.rows))
    if args.markdown:
        written.append(write_markdown(args.markdown, result))
    if args.plot:
        written.append(plot(args.plot, result))
    for path in written:
        err.print(f"wrote {path}")
    return 0


def run_check(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mixprec.keras.check import check
    from mixprec.keras.environment import collect
    from mixprec.report.check import check_report, plot

    if args.emulate:
        raise UsageError("--emulate is torch only; drop it with --framework tensorflow.")
    device, _ = _defaults(args.device)
    small = {"image_size": 32, "batch_size": 8}
    workload = _workload(args, small)
    policies = [p for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise UsageError("--policies is empty: nothing to check.")
    with err.status("checking") as status:
        result = check(
            workload,
            policies=policies,
            steps=args.steps,
            batch_size=_batch_size(args, small),
            device=device,
            fix=args.fix,
            progress=lambda msg: status.update(f"checking {msg}"),
        )
    out.print(check_report(result))
    if args.json:
        err.print(f"wrote {write_json(args.json, 'check', collect(device), result.to_dict())}")
    if args.plot:
        err.print(f"wrote {plot(args.plot, result)}")
    return 4 if result.failed else 0


def run_tune(args: argparse.Namespace, out: Console, err: Console, summary: Callable[[dict], Any]) -> int:
    """``summary`` renders the tune result (cli.tune's, passed in: no import cycle between the two)."""
    from mixprec.keras.tune import tune

    device, defaults = _defaults(args.device)
    workload = _workload(args, defaults)
    with err.status("tuning") as status:
        result = tune(
            workload,
            budget_s=args.budget,
            device=device,
            batch_size=_batch_size(args, defaults),
            steps=args.steps or defaults["steps"],
            warmup=defaults["warmup"],
            check_steps=args.check_steps,
            fix=not args.no_fix,
            xla=not args.no_compile,
            train_steps=args.train_steps,
            progress=lambda msg: status.update(msg),
        )
    result.command = "mixprec " + " ".join(sys.argv[1:])
    data = result.to_dict()
    out.print(summary(data))
    snippet = data["exports"].get("keras")
    if snippet:
        from rich.syntax import Syntax
        from rich.text import Text

        out.print(Text("Keras code:", style="bold"))
        out.print(Syntax(snippet, "python"))
    if args.json:
        err.print(f"wrote {write_json(args.json, 'tune', result.env, data)}")
    if args.report:
        from mixprec.report.html import write_report

        for path in write_report(result, Path(args.report)).values():
            err.print(f"wrote {path}")
    return 0


def env_section(device: str | None) -> dict[str, Any]:
    from mixprec.keras.environment import tensorflow_facts

    return tensorflow_facts(device)
