"""One line of text per finished candidate, for progress shown while a command runs."""

from __future__ import annotations

from typing import Any

from mixprec.report.format import fmt_db, fmt_small_pct, fmt_speedup, fmt_throughput


def bench_row_line(row: Any) -> tuple[str, str, str]:
    """(label, status, figure) of a finished bench row: '1,234.5 samples/s, 1.84x fp32' or its
    reason when it has no figure."""
    if row.throughput:
        figure = f"{fmt_throughput(row.throughput)} samples/s"
        speedup = fmt_speedup(row.speedup_vs_fp32)
        if speedup and row.label != "fp32":  # every row but the baseline itself
            figure += f", {speedup} fp32"
    else:
        figure = row.reason
    return row.label, str(row.status), figure


def verdict_line(check: Any) -> tuple[str, str, str]:
    """(label, verdict, figure) of a finished numerics check: the largest relative loss
    difference and the output SQNR, or the reason when there are none."""
    parts = []
    if check.max_rel_loss_diff is not None and str(check.verdict) != "unsupported":
        parts.append(f"max loss diff {fmt_small_pct(check.max_rel_loss_diff)}")
    if check.output_sqnr_db is not None:
        parts.append(f"output SQNR {fmt_db(check.output_sqnr_db)}")
    figure = ", ".join(parts) if parts else check.reason
    if str(check.verdict) in ("fail", "at-risk") and parts:
        figure += f" ({check.reason})"
    return check.candidate.label, str(check.verdict), figure


def clock(seconds: float) -> str:
    """'0:42', '12:05', '1:02:03'."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def progress_line(
    label: str,
    status: str,
    figure: str,
    *,
    elapsed_s: float,
    eta_s: float | None,
    eta_is_budget: bool = False,
    position: tuple[int, int] | None = None,
) -> str:
    """'[3/12] bf16-mixed: ok 1,234.5 samples/s, 1.84x fp32  (elapsed 0:42, eta 1:30)'."""
    head = f"[{position[0]}/{position[1]}] " if position else ""
    timing = f"elapsed {clock(elapsed_s)}"
    if eta_s is not None:
        # tune ends within its budget: what is left of it bounds the time left, it does not estimate it
        timing += f", at most {clock(eta_s)} left (budget)" if eta_is_budget else f", eta {clock(eta_s)}"
    text = f"{head}{label}: {status}"
    if figure:
        text += f" {figure}"
    return f"{text}  ({timing})"
