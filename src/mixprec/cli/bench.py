"""`mixprec bench`: the seed's benchmark table for any model, measured honestly."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from mixprec.cli.common import (
    THREADS_HELP,
    CandidateProgress,
    Defaults,
    add_batch_arg,
    add_workload_arguments,
    check_batch_arg,
    first_failure,
    positive_int,
    require_supported,
    threads_arg,
    workload_from_args,
)
from mixprec.errors import UsageError
from mixprec.measure.batches import bench_batches, parse_batch_sizes
from mixprec.measure.config import CHOICES, BenchConfig, parse_policies
from mixprec.measure.memory import parse_size
from mixprec.measure.results import write_csv
from mixprec.measure.sweep import bench
from mixprec.report.batches import batch_table
from mixprec.report.batches import plot as plot_batches
from mixprec.report.bench import bench_table, error_tracebacks, plot, write_markdown
from mixprec.report.jsonio import write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure every policy on the real training step")
    add_workload_arguments(p)
    p.add_argument("--policies", default="all", help="comma-separated policy names, or all (default)")
    p.add_argument(
        "--channels-last",
        choices=CHOICES,
        default="both",
        help="NCHW and/or NHWC tensors (torch; default both)",
    )
    p.add_argument(
        "--compile",
        choices=CHOICES,
        default="off",
        help="each candidate eager and/or compiled: torch.compile (torch), XLA (tensorflow); default off",
    )
    p.add_argument("--steps", type=positive_int, help="timed steps per candidate (at least)")
    p.add_argument("--threads", type=threads_arg, default="auto", help=THREADS_HELP)
    p.add_argument("--warmup", type=positive_int, help="untimed warm-up steps per candidate")
    p.add_argument(
        "--min-time", type=float, help="keep timing a candidate until this many seconds (at most 200 steps)"
    )
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="measure a candidate again, in up to five more sessions of at most 8 rounds, until its "
        "speedup's 95%% interval is within SHARE of it either side (0.05: a figure the next run repeats "
        "within about 10%%; at most 40 paired rounds)",
    )
    p.add_argument(
        "--prune-factor", type=float, default=5.0, help="stop candidates this many times slower than the best"
    )
    p.add_argument("--json", metavar="FILE", help="write results as JSON (rows also stream to FILE's .jsonl)")
    p.add_argument("--csv", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--resume", action="store_true", help="keep the rows already in the .jsonl next to --json")
    p.add_argument(
        "--resume-anyway",
        action="store_true",
        help="--resume, keeping rows measured under other settings too (steps, threads, versions, ...)",
    )
    p.add_argument(
        "--in-process", action="store_true", help="no child process per candidate (CPU memory: n/a)"
    )
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        help="train each candidate on N DDP ranks (gloo on CPU, nccl on CUDA); --batch-size is per rank",
    )
    p.add_argument(
        "--batch-sizes",
        metavar="SIZES",
        help="precision x batch: every candidate at each micro-batch size (e.g. 8,16,32), with its peak "
        "memory, a memory model fitted on them, and the Pareto front of throughput against memory",
    )
    p.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="with --batch-sizes: the memory a step may take (e.g. 16GiB); sizes past it are not timed, "
        "and each candidate's largest micro-batch within it is found and measured",
    )
    p.add_argument(
        "--effective-batch",
        type=positive_int,
        metavar="N",
        help="with --batch-sizes: samples per optimizer step at every size, by gradient accumulation "
        "(each size must divide N)",
    )
    add_batch_arg(p, "--batch-sizes")
    p.add_argument(
        "--xla",
        choices=CHOICES,
        dest="compile",
        default=argparse.SUPPRESS,
        help="--compile, by the name Keras users know",
    )
    p.set_defaults(run=run)


def bench_config(args: argparse.Namespace, defaults: Defaults) -> BenchConfig:
    """The command line as a :class:`BenchConfig` (the framework's defaults where a flag is not given)."""
    return BenchConfig(
        policies=args.policies,
        channels_last=args.channels_last,
        compile=args.compile,
        batch_size=defaults.batch_size(),
        steps=args.steps or defaults["steps"],
        warmup=args.warmup or defaults["warmup"],
        min_time_s=defaults["min_time"] if args.min_time is None else args.min_time,
        settle=args.settle,
        device=defaults.device,
        jsonl=Path(args.json).with_suffix(".jsonl") if args.json else None,
        resume=args.resume or args.resume_anyway,
        resume_anyway=args.resume_anyway,
        isolate=False if args.in_process else None,
        prune_factor=args.prune_factor,
        nproc=args.nproc,
        threads=args.threads,
    )


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    check_batch_arg(args, "--batch-sizes", bool(args.batch_sizes))
    if args.batch_sizes or args.memory_budget or args.effective_batch:
        return run_batches(args, out, err)
    resume = args.resume or args.resume_anyway
    if resume and not args.json:
        raise UsageError("--resume continues the rows in the .jsonl next to --json FILE; pass --json too.")
    defaults = Defaults(args, "bench")
    if not defaults.framework.layouts and args.channels_last == "on":
        raise UsageError(f"--channels-last on does not apply to {defaults.framework.title}; drop it.")
    if args.policies != "all":
        require_supported(parse_policies(args.policies), defaults)
    workload = workload_from_args(args, defaults)
    config = bench_config(args, defaults)
    jsonl = config.jsonl

    with CandidateProgress(err, "checking the workload: one strict-fp32 step", verbose=args.verbose) as shown:
        try:
            result = bench(workload, config, events=shown.event)
        except KeyboardInterrupt:
            if jsonl:
                err.print(
                    f"interrupted: finished rows are in {jsonl}; rerun with --resume to continue",
                    soft_wrap=True,
                )
            raise

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
    failure = first_failure(result.rows)
    if failure is not None:
        raise failure
    return 0


def run_batches(args: argparse.Namespace, out: Console, err: Console) -> int:
    """``--batch-sizes``: the precision x batch table instead of the one-size table."""
    if not args.batch_sizes:
        flag = "--memory-budget" if args.memory_budget else "--effective-batch"
        raise UsageError(f"{flag} applies to a precision x batch sweep; pass --batch-sizes too.")
    for flag, given in (("--resume", args.resume or args.resume_anyway), ("--nproc", args.nproc > 1)):
        if given:
            raise UsageError(f"{flag} is not available with --batch-sizes yet; drop it.")
    if args.batch_size is not None:
        raise UsageError("--batch-size and --batch-sizes both set the micro-batch; pass one of them.")
    sizes = parse_batch_sizes(args.batch_sizes)
    memory_budget = parse_size(args.memory_budget) if args.memory_budget else None
    defaults = Defaults(args, "bench")
    if args.policies != "all":
        require_supported(parse_policies(args.policies), defaults)
    workload = workload_from_args(args, defaults)
    # each size's sweep has its own batch size; the rows stream to no .jsonl (--json is the sweep's)
    config = replace(bench_config(args, defaults), batch_size=None, jsonl=None)
    with CandidateProgress(err, "peak memory at each batch size", verbose=args.verbose) as shown:
        sweep = bench_batches(
            workload,
            sizes,
            memory_budget=memory_budget,
            effective_batch=args.effective_batch,
            config=config,
            events=shown.event,
        )
    out.print(batch_table(sweep))
    written = []
    if args.json:
        env = defaults.framework.environment(defaults.device)
        written.append(write_json(args.json, "bench-batches", env, sweep.to_dict()))
    if args.plot:
        written.append(plot_batches(args.plot, sweep))
    for flag in ("csv", "markdown"):
        if getattr(args, flag):
            err.print(f"--{flag} is written for the one-size table only; the sweep is in --json")
    for path in written:
        err.print(f"wrote {path}")
    return 0 if any(r.samples_per_s for r in sweep.rows) else 1
