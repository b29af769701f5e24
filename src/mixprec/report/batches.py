"""Presentation of a precision x batch sweep: the table per candidate and micro-batch, the memory
models with their check, and a chart of throughput against peak memory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mixprec.measure.batches import BatchRow, BatchSweep
from mixprec.report.figure import save_figure
from mixprec.report.format import fmt_bytes, fmt_ms, fmt_pct, fmt_speedup, fmt_throughput, rich_style
from mixprec.status import Status


def _reason(row: BatchRow, sweep: BatchSweep) -> str:
    if row.status == Status.OVER_BUDGET:
        return f"peak {fmt_bytes(row.peak_bytes)} > budget {fmt_bytes(sweep.memory_budget)}"
    return row.reason


def batch_table(sweep: BatchSweep) -> Group:
    budget = f", memory budget {fmt_bytes(sweep.memory_budget)}" if sweep.memory_budget else ""
    if sweep.effective_batch:
        budget += f", {sweep.effective_batch} samples per optimizer step"
    table = Table(
        title=f"{sweep.workload} on {sweep.device}: precision x batch{budget}", title_justify="left"
    )
    for header, justify in (
        ("precision", "left"),
        ("batch", "right"),
        ("accum", "right"),
        ("status", "left"),
        ("samples/s", "right"),
        ("speedup vs fp32's best", "right"),
        ("step ms", "right"),
        ("peak memory", "right"),
        ("pareto", "center"),
        ("why", "left"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in sweep.rows:
        table.add_row(
            row.label,
            str(row.batch_size),
            str(row.accumulation_steps),
            Text(str(row.status), style=rich_style(row.status)),
            fmt_throughput(row.samples_per_s),
            fmt_speedup(row.speedup),
            fmt_ms(row.step_ms) if row.step_ms else "",
            fmt_bytes(row.peak_bytes),
            "*" if row.pareto else "",
            _reason(row, sweep),
        )
    models = Table(title="memory model: peak = fixed + per sample x batch", title_justify="left")
    for header in ("precision", "fixed", "per sample", "checked at", "error", "max batch", "its peak"):
        models.add_column(header, justify="left" if header == "precision" else "right")
    for label, model in sweep.models.items():
        check = model.check
        verified = sweep.verified.get(label)
        most = sweep.max_batch.get(label)
        models.add_row(
            label,
            fmt_bytes(model.fixed_bytes),
            fmt_bytes(model.per_sample_bytes),
            str(check.batch_size) if check else "-",
            fmt_pct(model.check_error, sign=True) if model.check_error is not None else "-",
            "-" if label not in sweep.max_batch else (str(most) if most else "none fits"),
            fmt_bytes(verified.peak_bytes) if verified else "",
        )
    method = next((p.method for m in sweep.models.values() for p in m.points if p.method), "")
    notes = [Text(n, style="dim") for n in sweep.notes]
    if method:
        notes.append(Text(f"peak memory: {method}", style="dim"))
    return Group(table, models, *notes)


def figure(sweep: BatchSweep) -> Any:
    """Throughput against peak memory, one line per candidate through its micro-batch sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(r.label for r in sweep.rows):
        rows = [r for r in sweep.rows if r.label == label and r.samples_per_s and r.peak_bytes]
        if not rows:
            continue
        xs = [(r.peak_bytes or 0) / 2**20 for r in rows]
        ys = [r.samples_per_s or 0.0 for r in rows]
        (line,) = ax.plot(xs, ys, "o-", label=label)
        for r, x, y in zip(rows, xs, ys, strict=True):
            ax.annotate(str(r.batch_size), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if r.pareto:
                ax.plot([x], [y], "o", markersize=11, markerfacecolor="none", color=line.get_color())
    if sweep.memory_budget:
        ax.axvline(sweep.memory_budget / 2**20, color="red", linestyle="--", label="memory budget")
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(
        f"{sweep.workload} on {sweep.device}: throughput vs peak memory\n"
        "(labels: micro-batch; circled: the Pareto front)",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(path: str | os.PathLike[str], sweep: BatchSweep) -> Path:
    return save_figure(figure(sweep), path, dpi=120)
