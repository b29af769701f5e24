"""The tune result in the terminal, from the view the HTML and Markdown report are built from
(:func:`mixprec.report.view.build`): the candidates table, the pick and its exports, the notes, what
did not run; and why a result holds no pick, as the error `mixprec tune` exits with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from mixprec.errors import BudgetExhausted, MixprecError, NumericsFailed, UsageError
from mixprec.exports.registry import EXPORT_TARGETS
from mixprec.measure.noise import describe as describe_noise
from mixprec.report.bench import drift_text
from mixprec.report.format import RICH_STYLES, fmt_bytes, fmt_phases, shorten
from mixprec.report.view import build, compile_text, untried_clauses
from mixprec.report.view_types import CANDIDATE_COLUMNS, Export, ReportView
from mixprec.status import Status

if TYPE_CHECKING:
    from mixprec.policy import Candidate
    from mixprec.tuning import TuneResult

_KEYS = tuple(c.key for c in CANDIDATE_COLUMNS)  # a report row's cells by column
_RIGHT = ("samples/s", "speedup vs fp32", "compute", "micro-batch", "peak memory")


def _body(view: ReportView, section: str) -> Any:
    return next(s.body for s in view.sections if s.id == section)


def candidate_table(result: TuneResult, view: ReportView | None = None) -> Table:
    """The report's candidates table cut to a terminal's width: label, status, samples/s, speedup,
    compute share, compile (when anything compiled), numerics and the reason, at most 90 characters;
    under --batch auto each candidate's micro-batch and the peak measured there."""
    table = Table(title=f"{result.workload} on {result.device}: candidates", title_justify="left")
    body = _body(view or build(result), "candidates")
    rows = [dict(zip(_KEYS, row.cells, strict=True)) for row in body.table.rows] if body else []
    compiled, batched = any(compile_text(r.row) for r in result.ranked), result.batches is not None
    columns = ["candidate", "status", "samples/s", "speedup vs fp32", "compute", "numerics", "why"]
    if compiled:
        columns.insert(4, "compile")
    if batched:
        columns[2:2] = ["micro-batch", "peak memory"]
    for col in columns:
        table.add_column(col, justify="right" if col in _RIGHT else "left")
    for ranked, cells in zip(result.ranked, rows, strict=True):
        row, status = ranked.row, cells["status"]
        shown: list[Any] = [
            ranked.label,
            Text(status.text, style=RICH_STYLES[status.tone]),
            f"{row.throughput:.1f}" if row and row.throughput else "",
            cells["speedup"].text,
            cells["share"].text,
        ]
        if compiled:
            shown.insert(4, compile_text(row, recompiles=False))
        if batched:
            shown[2:2] = _micro_batch_cells(result, ranked.candidate)
        table.add_row(*shown, cells["numerics"].text, shorten(ranked.reason or "", 90))
    return table


def _micro_batch_cells(result: TuneResult, cand: Candidate) -> list[str]:
    """'16 x 4' (micro-batch x accumulation steps) and the peak measured there by the batch search."""
    if cand.micro_batch is None:
        return ["", ""]
    plan = {p["label"]: p for p in (result.batches or {}).get("candidates") or []}
    chosen = plan.get(cand.policy + ("+cl" if cand.channels_last else "")) or {}
    peak = chosen.get("peak_memory_bytes") if chosen.get("micro_batch") == cand.micro_batch else None
    return [f"{cand.micro_batch} x {cand.accumulation_steps}", fmt_bytes(peak)]


def summary(result: TuneResult) -> Group:
    """What `mixprec tune` prints: the table, the pick (or why there is none) with the code that
    runs it, each export target, the notes, how noisy the machine was, what did not run, the time."""
    view, rec = build(result), result.recommendation
    parts: list[Any] = [candidate_table(result, view)]
    spent = fmt_phases(result.phases, result.budget_s)
    time_line = [Text(f"time: {spent}", style="dim")] if spent else []  # where the budget went
    if rec is None:
        parts.append(Text(no_recommendation(result).args[0], style="red"))
        parts += [Text(line, style="yellow") for line in untried_lines(result)]
        return Group(*parts, *time_line)
    pick = _body(view, "recommendation")
    cards = {c.name: c.value for c in pick.cards}
    style = "bold yellow" if rec.numerics_unverified else "bold green"
    head = Text.assemble(("recommended: ", "bold"), (pick.label, style))
    if rec.numerics_unverified:
        head.append(" (on speed alone: numerics not verified)", style="yellow")
    if "speedup vs fp32" in cards:
        head.append(f"  {cards['speedup vs fp32']} strict fp32")
    if "speedup vs tf32" in cards:
        head.append(f", {cards['speedup vs tf32']} tf32")
    if result.batches and rec.micro_batch:
        steps, peak = rec.accumulation_steps, fmt_bytes(rec.peak_memory_bytes)
        head.append(
            f"  micro-batch {rec.micro_batch} x {steps} accumulation = {rec.micro_batch * steps} "
            f"per optimizer step{f', peak {peak}' if rec.peak_memory_bytes else ''}"
        )
    parts += [head, Text(pick.reason)]
    if rec.numerics_unverified:  # picked on speed alone: said under the pick, not only in a note
        parts.append(Text(f"{rec.label}: {rec.numerics_unverified}", style="yellow"))
    if result.budget_exhausted:
        parts.append(Text(budget_exhausted(result).args[0], style="red"))
    if result.interrupted:
        said = f"interrupted: {result.interrupted}; the pick is from what ran before it"
        parts.append(Text(said, style="red"))
    parts += [Text(f"  lint {f.rule}: {f.message} -> {f.fix}") for f in pick.worth_fixing]
    # the backend's own export comes first: mixprec's get_policy for torch, Keras code for Keras; a
    # script's: the `mixprec run` line that runs the pick with no edit, then the change in its terms
    exports: Sequence[Export] = _body(view, "exports") or ()
    texts = {e.key: e.text for e in exports if not e.refused}
    if line := texts.pop("run", None):
        parts += [Text("run your script unchanged with it:", style="bold"), Text(line)]
    if snippet := next(iter(texts.values()), None):
        where = "or change your script:" if line else "paste into your training script:"
        parts += [Text(where, style="bold"), Syntax(snippet, "python")]
    parts += export_lines(exports)
    check = result.check
    notes = [*result.notes, check.power if check else "", check.reference_note if check else ""]
    parts += [Text(f"note: {note}", style="yellow") for note in notes if note]
    measured = [m for m in (drift_text(result.bench.baseline_drift), describe_noise(result.bench.noise)) if m]
    if measured:
        parts.append(Text("measured: " + "; ".join(measured), style="dim"))
    parts += [Text(line, style="yellow") for line in untried_lines(result)]  # the last word: what did not run
    return Group(*parts, *time_line)


def untried_lines(result: TuneResult) -> list[str]:
    """What the decision did not see measured, a line per kind (the banner's clauses,
    :func:`mixprec.report.view.untried_clauses`, each list whole)."""
    return [clause[0].lower() + clause[1:] for clause in untried_clauses(result)]


def export_lines(exports: Sequence[Export]) -> list[Text]:
    """Per export target of the report's exports, in :data:`EXPORT_TARGETS` order: "faithful" (its
    text is in the JSON and the report) or "refused: why"."""
    if not exports:
        return []
    lines = [Text("exports (mixprec tune --json / --report hold the texts):", style="bold")]
    order = {target: i for i, target in enumerate(EXPORT_TARGETS)}
    for e in sorted(exports, key=lambda e: order.get(e.key, len(order))):
        verdict = (("refused", "yellow"), f": {e.refused}") if e.refused else (("faithful", "green"),)
        lines.append(Text.assemble(f"  {e.key}: ", *verdict))
    return lines


def budget_exhausted(result: TuneResult) -> BudgetExhausted:
    return BudgetExhausted(f"budget exhausted: {result.budget_exhausted}; raise --budget.")


def no_recommendation(result: TuneResult) -> MixprecError:
    """Why a tune result holds no recommendation, as the error the CLI exits with: the budget ran
    out first (exit 5), every candidate failed to run (exit 2), or no candidate passed (exit 4);
    interrupted first, that (the CLI exits 130 for the signal itself)."""
    rows = [r for r in result.bench.rows if not r.baseline_repeat]
    failed = [r for r in rows if r.status in (Status.ERROR, Status.OOM)]
    if result.budget_exhausted:
        return budget_exhausted(result)
    if result.interrupted and not any(r.status == Status.OK for r in rows):
        return MixprecError(f"interrupted: {result.interrupted}, so nothing was measured or checked")
    if not any(r.status == Status.OK for r in rows) and result.bench.stopped:
        return BudgetExhausted(
            f"budget exhausted: the {result.budget_s:g} s budget ran out before strict fp32 was "
            f"measured ({result.bench.stopped}), so nothing was measured or checked; raise --budget."
        )
    if rows and len(failed) == len(rows):
        first = failed[0]
        return UsageError(
            f"every candidate failed ({len(rows)} rows), so nothing was checked; the first, "
            f"{first.label}: {first.status}: {first.reason}"
        )
    return NumericsFailed("no candidate passed the numerics check, not even strict fp32.")
