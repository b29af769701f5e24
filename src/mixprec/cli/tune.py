"""`mixprec tune`: measure, gate by numerics, recommend, export; `mixprec report` re-renders."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from rich.console import Console

from mixprec.checking.config import TRAIN_STEPS, CheckConfig
from mixprec.cli.common import (
    THREADS_HELP,
    CandidateProgress,
    Defaults,
    add_batch_arg,
    add_workload_arguments,
    check_batch_arg,
    positive_int,
    require_supported,
    threads_arg,
    workload_from_args,
)
from mixprec.cli.interrupt import graceful
from mixprec.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, MixprecError, NumericsInconclusive, UsageError
from mixprec.measure.config import BenchConfig, parse_policies
from mixprec.measure.memory import parse_size
from mixprec.policy import Candidate
from mixprec.policy.candidate import COMPILE_MODES
from mixprec.report.jsonio import write_json
from mixprec.report.tune import budget_exhausted, no_recommendation, summary
from mixprec.tuning.config import TuneConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="find the fastest policy that trains like fp32, with evidence and exports"
    )
    add_workload_arguments(p)
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole search (default 300)")
    p.add_argument(
        "--policies",
        default="all",
        help="the precisions to choose among: comma-separated policy names, or all (default); strict "
        "fp32 is always measured, as every candidate's reference",
    )
    p.add_argument("--steps", type=positive_int, help="timed steps per candidate")
    p.add_argument("--threads", type=threads_arg, default="auto", help=THREADS_HELP)
    p.add_argument("--check-steps", type=positive_int, default=6, help="training steps compared with fp32")
    p.add_argument(
        "--no-fix", action="store_true", help="do not search keep_fp32 rescues for failing policies"
    )
    p.add_argument("--no-lint", action="store_true")
    p.add_argument(
        "--compile",
        metavar="MODE[,MODE]",
        default=None,
        type=compile_modes,
        help="compile modes tried on the best eager candidates: torch.compile's "
        f"({', '.join(COMPILE_MODES)}; default: default) or xla (tensorflow, the default there)",
    )
    p.add_argument("--no-compile", action="store_true", help="eager candidates only")
    p.add_argument(
        "--no-optimizers",
        action="store_true",
        help="do not try the optimizer's foreach/fused implementations",
    )
    p.add_argument(
        "--train-steps",
        type=positive_int,
        default=TRAIN_STEPS,
        help=f"length of your training run; compile time is amortised over it (default {TRAIN_STEPS})",
    )
    p.add_argument(
        "--batch",
        choices=("auto",),
        help="auto: search the micro-batch with the precision: each candidate at the largest micro-batch "
        "that fits --memory-budget, gradient accumulation keeping --effective-batch samples per step",
    )
    p.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="with --batch auto: the memory a step may take (e.g. 16GiB; on CUDA default: the free "
        "memory less 10%%; a CPU needs it)",
    )
    p.add_argument(
        "--effective-batch",
        type=positive_int,
        metavar="N",
        help="with --batch auto: samples per optimizer step (default: --batch-size, else the workload's; "
        "a script's: its --batch-arg value)",
    )
    add_batch_arg(p, "--batch auto")
    p.add_argument("--json", metavar="FILE", help="everything tune measured and decided, as JSON")
    p.add_argument("--report", metavar="DIR", help="write DIR/index.html and DIR/report.md")
    p.set_defaults(run=run)

    r = sub.add_parser("report", help="re-render a saved `mixprec tune --json` file as HTML and Markdown")
    r.add_argument("results", help="JSON written by mixprec tune --json")
    r.add_argument("--out", metavar="DIR", default="mixprec-report")
    r.set_defaults(run=run_report)


def compile_modes(text: str) -> tuple[str, ...]:
    """'default,max-autotune' -> the modes; which are valid is the framework's (tune checks them)."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes:
        raise argparse.ArgumentTypeError(f"no compile mode in {text!r}; name one, or pass --no-compile")
    return modes


def tune_config(args: argparse.Namespace, defaults: Defaults) -> TuneConfig:
    """The command line as a :class:`TuneConfig` (the framework's defaults where a flag is not given)."""
    return TuneConfig(
        bench=BenchConfig(
            device=defaults.device,
            batch_size=defaults.batch_size(),
            steps=args.steps or defaults["steps"],
            warmup=defaults["warmup"],
            threads=args.threads,
        ),
        check=CheckConfig(steps=args.check_steps, fix=not args.no_fix, train_steps=args.train_steps),
        policies=args.policies,
        budget_s=args.budget,
        lint=not args.no_lint,
        compile_modes=() if args.no_compile else args.compile,
        optimizers=not args.no_optimizers,
        batch=args.batch,
        memory_budget=parse_size(args.memory_budget) if args.memory_budget else None,
        effective_batch=args.effective_batch,
    )


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mixprec.tuning import tune

    if args.batch is None and (args.memory_budget or args.effective_batch):
        flag = "--memory-budget" if args.memory_budget else "--effective-batch"
        raise UsageError(f"{flag} applies to the micro-batch search; pass --batch auto too.")
    check_batch_arg(args, "--batch auto", args.batch is not None)
    defaults = Defaults(args, "tune")
    framework = defaults.framework
    if args.policies != "all":  # fp8 on a device without it is still tuned for: its numerics predicted
        require_supported(
            parse_policies(args.policies),
            defaults,
            allowed=lambda cand, info: framework.predictable(cand, info) is not None,
        )
    for mode in args.compile or ():  # a typo fails before the workload is built
        framework.validate(Candidate("fp32", compile=mode, framework=framework.name))
    workload = workload_from_args(args, defaults)
    own = None
    if args.batch_arg:
        from mixprec.frameworks.script.batch import arg_of

        own = arg_of(workload)
    if own is not None and args.effective_batch not in (None, own.value):
        raise UsageError(
            f"--effective-batch {args.effective_batch} over a script: its effective batch is its own "
            f"{own.flag} {own.value}; change it there (or drop --effective-batch)."
        )
    config = tune_config(args, defaults)
    with (
        graceful(lambda text: err.print(f"mixprec: {text}")) as interrupt,
        CandidateProgress(err, "tuning", verbose=args.verbose, budget_s=args.budget) as shown,
    ):
        result = tune(workload, config, events=shown.event, interrupt=interrupt.stop)
    result.command = "mixprec " + shlex.join(args.argv)
    out.print(summary(result))
    if args.json:
        err.print(f"wrote {write_json(args.json, 'tune', result.env, result.to_dict())}")
    if args.report:
        from mixprec.report.html import write_report

        for path in write_report(result, Path(args.report)).values():
            err.print(f"wrote {path}")
    if interrupt.signal:  # what was measured is written; the command still ends as interrupted
        err.print(f"mixprec: {'terminated' if interrupt.signal == 'SIGTERM' else 'interrupted'}")
        return EXIT_TERMINATED if interrupt.signal == "SIGTERM" else EXIT_INTERRUPTED
    if result.recommendation is None:
        raise no_recommendation(result)
    if result.budget_exhausted:
        raise budget_exhausted(result)
    if result.recommendation.numerics_unverified:
        raise NumericsInconclusive(
            f"{result.recommendation.label} was picked on speed alone: "
            f"{result.recommendation.numerics_unverified}."
        )
    return 0


def render_tune_file(path: Path) -> dict[str, tuple[str, bytes]]:
    """The report files (:func:`mixprec.report.html.render_report`) of a ``mixprec tune --json``
    file; a UsageError naming the problem for anything else (missing, a folder, binary, not JSON,
    another kind, a malformed result)."""
    from mixprec.report.html import render_report
    from mixprec.tuning import TuneResult

    name = str(path)
    fix = "pass the file written by `mixprec tune --json`"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"results file {name!r} does not exist; {fix}.") from None
    except IsADirectoryError:
        raise UsageError(f"results file {name!r} is a folder; {fix}.") from None
    except OSError as exc:
        raise UsageError(f"cannot read results file {name!r} ({exc.strerror or exc}); {fix}.") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"results file {name!r} is not text (not UTF-8); {fix}.") from None
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"results file {name!r} is not JSON ({str(exc)[:80]}); {fix}.") from None
    if not isinstance(data, dict) or data.get("kind") != "tune":
        kind = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise UsageError(
            f"results file {name!r} has kind {kind!r}; `mixprec report` renders kind 'tune' "
            "(written by `mixprec tune --json`)."
        )
    try:
        result = TuneResult.from_dict(data)
        files = render_report(result)  # rendered in memory: a malformed value fails before any write
    except MixprecError:
        raise
    except Exception as exc:  # a hand-edited or truncated result: say what, not where in mixprec
        raise UsageError(
            f"results file {name!r} is not a valid tune result ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:100] if str(exc) else 'malformed'}); {fix}."
        ) from None
    return files


def run_report(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mixprec.report.html import write_files

    files = render_tune_file(Path(args.results))
    for written in write_files(files, Path(args.out)).values():
        err.print(f"wrote {written}")
    return 0
