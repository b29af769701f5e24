"""`mixprec tune`: measure, gate by numerics, recommend, export; `mixprec report` re-renders."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from mixprec.checking.config import TRAIN_STEPS, CheckConfig
from mixprec.cli.common import (
    THREADS_HELP,
    CandidateProgress,
    Defaults,
    add_workload_arguments,
    positive_int,
    threads_arg,
    workload_from_args,
)
from mixprec.cli.interrupt import graceful
from mixprec.errors import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    BudgetExhausted,
    MixprecError,
    NumericsFailed,
    NumericsInconclusive,
    UsageError,
)
from mixprec.exports import EXPORT_TARGETS
from mixprec.measure.config import BenchConfig
from mixprec.measure.memory import parse_size
from mixprec.measure.noise import describe as describe_noise
from mixprec.policy import Candidate
from mixprec.policy.candidate import COMPILE_MODES
from mixprec.report.bench import drift_text
from mixprec.report.format import fmt_bytes, fmt_phases, fmt_speedup_ci, rich_style, shorten
from mixprec.report.jsonio import write_json
from mixprec.status import Status
from mixprec.tuning.config import TuneConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="find the fastest policy that trains like fp32, with evidence and exports"
    )
    add_workload_arguments(p)
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole search (default 300)")
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
        help="with --batch auto: samples per optimizer step (default: --batch-size, else the workload's)",
    )
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


def compile_cell(c: dict[str, Any]) -> str:
    """'41 s, 2 breaks' for a compiled candidate: what compiling it cost and how cleanly it traced."""
    if c.get("compile_s") is None:
        return ""
    breaks = c.get("graph_breaks")
    tail = f", {breaks} break{'s' if breaks != 1 else ''}" if breaks is not None else ""
    return f"{c['compile_s']:.0f} s{tail}"


def candidate_table(data: dict[str, Any]) -> Table:
    table = Table(title=f"{data['workload']} on {data['device']}: candidates", title_justify="left")
    compiled = any(c.get("compile_s") is not None for c in data["candidates"])
    batched = data.get("batches") is not None
    columns = ["candidate", "status", "samples/s", "speedup vs fp32", "compute", "numerics", "why"]
    if compiled:
        columns.insert(4, "compile")
    if batched:  # --batch auto: each candidate's micro-batch and its measured peak
        columns[2:2] = ["micro-batch", "peak memory"]
    for col in columns:
        right = ("samples/s", "speedup vs fp32", "compute", "micro-batch", "peak memory")
        table.add_column(col, justify="right" if col in right else "left")
    for c in data["candidates"]:
        share = c.get("compute_share")
        cells = [
            c["label"],
            Text(c["status"], style=rich_style(c["status"])),
            f"{c['throughput']:.1f}" if c.get("throughput") else "",
            fmt_speedup_ci(c.get("speedup_vs_fp32"), c.get("repeat_ci") or c.get("speedup_ci")),
            f"{share:.0%}" if share is not None else "",
        ]
        if compiled:
            cells.insert(4, compile_cell(c))
        if batched:
            cells[2:2] = micro_batch_cells(data, c)
        table.add_row(
            *cells,
            c.get("verdict") or "",
            shorten(c.get("reason") or "", 90),
        )
    return table


def micro_batch_cells(data: dict[str, Any], c: dict[str, Any]) -> list[str]:
    """'16 x 4' (micro-batch x accumulation steps) and the peak measured there by the batch search."""
    cand = c.get("candidate") or {}
    micro, steps = cand.get("micro_batch"), cand.get("accumulation_steps") or 1
    if micro is None:
        return ["", ""]
    eager = cand.get("policy", "") + ("+cl" if cand.get("channels_last") else "")
    plan = {p["label"]: p for p in (data.get("batches") or {}).get("candidates") or []}
    chosen = plan.get(eager) or {}
    peak = chosen.get("peak_memory_bytes") if chosen.get("micro_batch") == micro else None
    return [f"{micro} x {steps}", fmt_bytes(peak)]


def summary(data: dict[str, Any]) -> Group:
    rec = data.get("recommendation")
    parts: list[Any] = [candidate_table(data)]
    spent = fmt_phases(data.get("phases") or {}, data.get("budget_s"))
    time_line = [Text(f"time: {spent}", style="dim")] if spent else []  # where the budget went
    if rec is None:
        parts.append(Text(no_recommendation(data).args[0], style="red"))
        parts += [Text(line, style="yellow") for line in untried_lines(data)]
        return Group(*parts, *time_line)
    verified = not rec.get("numerics_unverified")
    head = Text.assemble(
        ("recommended: ", "bold"), (rec["label"], "bold green" if verified else "bold yellow")
    )
    if not verified:
        head.append(" (on speed alone: numerics not verified)", style="yellow")
    if rec.get("speedup_vs_fp32"):
        head.append(f"  {rec['speedup_vs_fp32']:.2f}x strict fp32")
    if rec.get("speedup_vs_tf32"):
        head.append(f", {rec['speedup_vs_tf32']:.2f}x tf32")
    if data.get("batches") and rec.get("micro_batch"):
        steps = rec.get("accumulation_steps") or 1
        peak = f", peak {fmt_bytes(rec['peak_memory_bytes'])}" if rec.get("peak_memory_bytes") else ""
        head.append(
            f"  micro-batch {rec['micro_batch']} x {steps} accumulation = {rec['micro_batch'] * steps} "
            f"per optimizer step{peak}"
        )
    parts += [head, Text(rec["reason"])]
    if rec.get("numerics_unverified"):  # picked on speed alone: said under the pick, not only in a note
        parts.append(Text(f"{rec['label']}: {rec['numerics_unverified']}", style="yellow"))
    if data.get("budget_exhausted"):
        parts.append(Text(budget_exhausted(data).args[0], style="red"))
    for finding in rec.get("lint_worth_fixing") or []:
        parts.append(Text(f"  lint {finding.get('rule')}: {finding.get('message')} -> {finding.get('fix')}"))
    # the backend's own export comes first: mixprec's get_policy for torch, Keras code for Keras; a
    # script's: the `mixprec run` line that runs the pick with no edit, then the change in its terms
    exports = dict(data.get("exports") or {})
    line = exports.pop("run", None)
    if line:
        parts += [Text("run your script unchanged with it:", style="bold"), Text(line)]
    snippet = next(iter(exports.values()), None)
    if snippet:
        where = "or change your script:" if line else "paste into your training script:"
        parts += [Text(where, style="bold"), Syntax(snippet, "python")]
    parts += export_lines(data)
    for note in data.get("notes") or []:
        parts.append(Text(f"note: {note}", style="yellow"))
    power = (data.get("check") or {}).get("power")
    if power:  # the checks compared more steps than asked: the reference needed them to learn
        parts.append(Text(f"note: {power}", style="yellow"))
    reference = (data.get("check") or {}).get("reference_note")
    if reference:
        parts.append(Text(f"note: {reference}", style="yellow"))
    bench = data.get("bench") or {}
    measured = [drift_text(bench.get("baseline_drift")), describe_noise(bench.get("noise") or {})]
    if any(measured):
        parts.append(Text("measured: " + "; ".join(m for m in measured if m), style="dim"))
    parts += [Text(line, style="yellow") for line in untried_lines(data)]  # the last word: what did not run
    return Group(*parts, *time_line)


def untried_lines(data: dict[str, Any]) -> list[str]:
    """What the decision did not see measured, a line per kind: not measured (the budget ended
    first, with the budget that would try them), predicted only, too noisy to rank."""
    rows = data.get("candidates") or []

    def labels(status: str) -> list[str]:
        return [c["label"] for c in rows if c.get("status") == status]

    lines = []
    rec = data.get("recommendation") or {}
    if missing := labels(Status.NOT_MEASURED):
        more = rec.get("budget_to_try_s")
        tail = f"; about --budget {more:g} would try them" if more else "; raise --budget to try them"
        lines.append(f"not measured, the budget ended first: {', '.join(missing)}{tail}")
    predicted = [
        f"{c['label']} ({_predicted_verdict(c['verdict'])})" if c.get("verdict") else c["label"]
        for c in rows
        if c.get("status") == Status.PREDICTED
    ]
    if predicted:
        lines.append(f"predicted only, speed not measurable on this device: {', '.join(predicted)}")
    if noisy := labels(Status.NOISY):
        lines.append(f"too noisy to rank, set aside: {', '.join(noisy)}")
    return lines


def budget_exhausted(data: dict[str, Any]) -> BudgetExhausted:
    return BudgetExhausted(f"budget exhausted: {data['budget_exhausted']}; raise --budget.")


def no_recommendation(data: dict[str, Any]) -> MixprecError:
    """Why a tune result holds no recommendation, as the error the CLI exits with: the budget ran
    out first (exit 5), every candidate failed to run (exit 2), or no candidate passed (exit 4)."""
    bench = data.get("bench") or {}
    rows = [r for r in bench.get("rows") or [] if isinstance(r, dict) and not r.get("baseline_repeat")]
    failed = [r for r in rows if r.get("status") in (Status.ERROR, Status.OOM)]
    if data.get("budget_exhausted"):
        return budget_exhausted(data)
    if not any(r.get("status") == Status.OK for r in rows) and bench.get("stopped"):
        return BudgetExhausted(
            f"budget exhausted: the {data.get('budget_s', 0):g} s budget ran out before strict fp32 was "
            f"measured ({bench['stopped']}), so nothing was measured or checked; raise --budget."
        )
    if rows and len(failed) == len(rows):
        first = failed[0]
        return UsageError(
            f"every candidate failed ({len(rows)} rows), so nothing was checked; the first, "
            f"{first.get('label')}: {first.get('status')}: {first.get('reason')}"
        )
    return NumericsFailed("no candidate passed the numerics check, not even strict fp32.")


def export_lines(data: dict[str, Any]) -> list[Text]:
    """Per export target: "faithful" (its text is in the JSON and the report) or "refused: why"."""
    exports, refusals = data.get("exports") or {}, data.get("export_refusals") or {}
    if not exports and not refusals:
        return []
    lines = [Text("exports (mixprec tune --json / --report hold the texts):", style="bold")]
    named = [*exports, *refusals]
    for target in [t for t in EXPORT_TARGETS if t in named] + [t for t in named if t not in EXPORT_TARGETS]:
        if target in exports:
            lines.append(Text.assemble(f"  {target}: ", ("faithful", "green")))
        else:
            lines.append(Text.assemble(f"  {target}: ", ("refused", "yellow"), f": {refusals[target]}"))
    return lines


def _predicted_verdict(verdict: str) -> str:
    """A predicted row's verdict in words: pass and fail as predicted, inconclusive as it is."""
    if verdict == Status.PASS:
        return "would pass"
    return "inconclusive" if verdict == Status.INCONCLUSIVE else "would fail"


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
    defaults = Defaults(args, "tune")
    framework = defaults.framework
    for mode in args.compile or ():  # a typo fails before the workload is built
        framework.validate(Candidate("fp32", compile=mode, framework=framework.name))
    workload = workload_from_args(args, defaults)
    config = tune_config(args, defaults)
    with (
        graceful(lambda text: err.print(f"mixprec: {text}")) as interrupt,
        CandidateProgress(err, "tuning", verbose=args.verbose, budget_s=args.budget) as shown,
    ):
        result = tune(workload, config, events=shown.event, stop=interrupt.stop)
    result.command = "mixprec " + shlex.join(args.argv)
    data = result.to_dict()
    out.print(summary(data))
    if args.json:
        err.print(f"wrote {write_json(args.json, 'tune', result.env, data)}")
    if args.report:
        from mixprec.report.html import write_report

        for path in write_report(result, Path(args.report)).values():
            err.print(f"wrote {path}")
    if interrupt.signal:  # what was measured is written; the command still ends as interrupted
        err.print(f"mixprec: {'terminated' if interrupt.signal == 'SIGTERM' else 'interrupted'}")
        return EXIT_TERMINATED if interrupt.signal == "SIGTERM" else EXIT_INTERRUPTED
    if result.recommendation is None:
        raise no_recommendation(data)
    if result.budget_exhausted:
        raise budget_exhausted(data)
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
