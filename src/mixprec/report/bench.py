"""Presentation of bench results: the table of SURF's 'Deep Learning on A100 GPUs' benchmark, for any
model (rich and Markdown), and a PNG chart."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mixprec.files import atomic_write_text
from mixprec.measure.noise import describe as describe_noise
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.report.figure import figure_bytes, save_figure
from mixprec.report.format import fmt_bytes, fmt_ms, fmt_speedup_ci, rich_style


def _cells(row: BenchRow) -> dict[str, str]:
    st = row.step_time_ms
    return {
        "candidate": row.label,
        "status": row.status,
        "throughput": f"{row.throughput:.1f}" if row.throughput else "",
        "speedup": fmt_speedup_ci(row.speedup_vs_fp32, row.interval),
        "step": fmt_ms(st.median_ms, st.iqr_ms) if st else "",
        "n": str(st.n) if st else "",
        "first_loss": f"{row.first_loss:.4f}" if row.first_loss is not None else "",
        "memory": (fmt_bytes(row.peak_memory_bytes) or "n/a") if row.step_time_ms else "",
        "tflops": f"{row.achieved_tflops:.3f}" if row.achieved_tflops else "",
        "mfu": f"{row.mfu:.1%}" if row.mfu else ("n/a" if row.mfu_note else ""),
        "dtype": row.observed_dtype or "",
        "reason": row.reason,
    }


_COLUMNS = (
    ("candidate", "precision", "left"),
    ("status", "status", "left"),
    ("throughput", "samples/s", "right"),
    ("speedup", "speedup vs fp32", "right"),
    ("step", "step ms med ± IQR", "right"),
    ("n", "n", "right"),
    ("first_loss", "first-iter loss", "right"),
    ("memory", "peak memory", "right"),
    ("tflops", "TFLOP/s", "right"),
    ("mfu", "MFU", "right"),
    ("dtype", "ran as", "left"),
)


def bench_table(result: BenchResult) -> Group:
    world = max((r.world_size for r in result.rows), default=1)
    ranks = f" per rank x {world} DDP ranks" if world > 1 else ""
    title = f"{result.workload} on {result.device}, batch {result.batch_size}{ranks}"
    table = Table(title=title, title_justify="left")
    for _, header, justify in _COLUMNS:
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    notes: list[Text] = []
    for row in result.rows:
        cells = _cells(row)
        values: list[Any] = [cells[key] for key, _, _ in _COLUMNS]
        values[1] = Text(row.status, style=rich_style(row.status))
        table.add_row(*values)
        if row.reason:
            notes.append(Text(f"  {row.label}: {row.reason}", style=rich_style(row.status)))
        for note in (*row.notes, row.mfu_note):
            if note and note not in result.notes:  # said once for the whole table
                notes.append(Text(f"  {row.label}: {note}", style="dim"))
        if row.world_size > 1 and row.rank_step_time_ms:
            spread = ", ".join(f"{t:.1f}" for t in row.rank_step_time_ms)
            notes.append(Text(f"  {row.label}: median step ms per rank: {spread}", style="dim"))
    parts: list[Any] = [table]
    notes = [Text(f"  {note}") for note in result.notes] + notes
    if notes:
        parts.append(Text("notes:"))
        parts.extend(notes)
    parts.append(Text(summary_line(result)))
    return Group(*parts)


def error_tracebacks(result: BenchResult) -> str:
    """The tracebacks of the rows that failed with an error (what ``--debug`` adds under the table)."""
    return "\n".join(
        f"{row.label}: {row.reason}\n{row.error_traceback}" for row in result.rows if row.error_traceback
    )


def drift_text(drift: float | None) -> str:
    """The baseline's drift in words: which way, how much, from when to when."""
    if drift is None:
        return ""
    if abs(drift) < 0.005:
        return "strict fp32 ran at the same speed at the end of the sweep as at its start"
    way = "slower" if drift > 0 else "faster"
    return f"strict fp32 was {abs(drift):.0%} {way} at the end of the sweep than at its start"


def summary_line(result: BenchResult) -> str:
    best = result.best()
    pieces = []
    if best is not None:
        speed = fmt_speedup_ci(best.speedup_vs_fp32, best.interval) or "no fp32 baseline"
        pieces.append(f"fastest: {best.label} ({best.throughput:.1f} samples/s, {speed} strict fp32)")
    drift = drift_text(result.baseline_drift)
    if drift:
        pieces.append(drift)
    flops = next((r.flops_per_step for r in result.rows if r.flops_per_step), None)
    if flops:
        pieces.append(f"{flops / 1e9:.2f} GFLOP per step (torch.utils.flop_counter)")
    noise_line = describe_noise(result.noise)
    if noise_line:
        pieces.append(f"machine noise: {noise_line}")
    if result.between_run_sd:
        pieces.append(
            "the intervals are where a repeat run lands, 19 times in 20: this run's noise and a "
            f"spread between runs of {result.between_run_sd:.1%} ({result.between_run_basis})"
        )
    if result.stopped:
        pieces.append(result.stopped)
    return "; ".join(pieces) + "." if pieces else "no candidate finished."


def markdown_table(result: BenchResult) -> str:
    lines = [
        f"### {result.workload} on {result.device}, batch {result.batch_size}",
        "",
        "| " + " | ".join(h for _, h, _ in _COLUMNS) + " | note |",
        "|" + "|".join("---:" if j == "right" else "---" for _, _, j in _COLUMNS) + "|---|",
    ]
    for row in result.rows:
        cells = _cells(row)
        lines.append(
            "| " + " | ".join(cells[k] for k, _, _ in _COLUMNS) + f" | {row.reason.replace('|', '/')} |"
        )
    lines += ["", summary_line(result), ""]
    return "\n".join(lines)


def write_markdown(path: str | os.PathLike[str], result: BenchResult) -> Path:
    return atomic_write_text(path, markdown_table(result), "--markdown file")


def chart_speedup(row: BenchRow) -> float:
    """A row's bar in the speed chart: its paired speedup over strict fp32 (0 where it has none)."""
    return (row.speedup_vs_fp32 or 0.0) if row.status in ("ok", "pruned") else 0.0


def figure(result: BenchResult) -> Any:
    """Paired speedup and peak memory per candidate (the table's figures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if not r.baseline_repeat and r.status != "unsupported"]
    hidden = [r.label for r in result.rows if r.status == "unsupported"]
    labels = [r.label for r in rows]
    colors = {
        "ok": "#3b7dd8",
        "pruned": "#e0a030",
        "error": "#c0392b",
        "oom": "#c0392b",
        "unsupported": "#bbbbbb",
    }
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.42 * len(rows) + 1.8)))
    ypos = range(len(rows))
    # One figure per bar: its length and its label are both the paired speedup (the table's
    # speedup column); a row's own samples/s comes from its own median step, taken at other
    # moments than the baseline's, so on a busy machine it need not be the speedup times fp32's.
    speed = [chart_speedup(r) for r in rows]
    bars = ax_t.barh(ypos, speed, color=[colors.get(r.status, "#999") for r in rows])
    for r, b in zip(rows, bars, strict=True):
        own = f", {r.throughput:,.1f}/s" if r.throughput else ""
        if r.status == "ok" and r.speedup_vs_fp32:
            text = f" {r.speedup_vs_fp32:.2f}x{own}"
        elif r.status == "pruned":
            text = f" pruned ({r.speedup_vs_fp32:.2f}x)" if r.speedup_vs_fp32 else " pruned"
        else:
            text = f" {r.status}"
        ax_t.text(b.get_width(), b.get_y() + b.get_height() / 2, text, va="center", fontsize=8)
    ax_t.set_yticks(list(ypos), labels)
    ax_t.invert_yaxis()
    ax_t.axvline(1.0, color="#888888", linewidth=0.8, linestyle=":")
    ax_t.set_xlabel("speedup vs strict fp32 (paired step by step)")
    ax_t.set_title("speedup (label: speedup, then samples/s of its own steps)", fontsize=9)
    ax_t.set_xlim(0, max([*speed, 1.0]) * 1.45)

    mem = [(r.peak_memory_bytes or 0) / 2**20 for r in rows]
    ax_m.barh(
        ypos, mem, color=[colors.get(r.status, "#999") if r.peak_memory_bytes else "#eeeeee" for r in rows]
    )
    for i, r in enumerate(rows):
        if r.step_time_ms and r.peak_memory_bytes is None:
            ax_m.text(0, i, " n/a", va="center", fontsize=8)
    ax_m.set_yticks(list(ypos), labels)
    ax_m.invert_yaxis()
    ax_m.set_xlabel("peak memory (MiB)")
    method = next((r.memory_method for r in rows if r.memory_method), "")
    # how it was measured can be a long sentence: wrapped, so it stays above its own panel
    ax_m.set_title("peak memory" + (f"\n{textwrap.fill(f'({method})', 55)}" if method else ""), fontsize=9)
    fig.suptitle(
        f"{result.workload} on {result.device} ({result.env.get('device', {}).get('name', '')}), "
        f"batch {result.batch_size}",
        fontsize=10,
    )
    if hidden:
        fig.text(
            0.01, 0.01, "not shown (unsupported here): " + ", ".join(hidden), fontsize=7, color="#666666"
        )
    fig.tight_layout(rect=(0, 0.04 if hidden else 0, 1, 1))
    return fig


def plot(path: str | os.PathLike[str], result: BenchResult) -> Path:
    """The chart of :func:`figure`, written to ``path`` (its suffix picks png, svg or pdf)."""
    return save_figure(figure(result), path, dpi=120)


def png(result: BenchResult) -> bytes:
    """The chart of :func:`figure` as PNG bytes."""
    return figure_bytes(figure(result), "png", dpi=120)
