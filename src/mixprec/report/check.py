"""Presentation of `check` results: verdict table, evidence, the keep-fp32 fix, and plots."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mixprec.frameworks import Framework, known_framework
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.report.figure import figure_bytes, save_figure
from mixprec.report.format import fmt_bits, fmt_db, fmt_pct, rich_style


def fix_snippet(c: CandidateCheck) -> str:
    keep = [*c.candidate.keep_fp32, *c.fix_keep_fp32]
    framework = known_framework(c.candidate.framework) or Framework()
    return framework.fix_snippet(c.candidate, keep)


def check_report(result: CheckResult) -> Group:
    table = Table(
        title=(
            f"{result.workload} on {result.device}: {result.steps} steps, batch {result.batch_size}, "
            "vs strict fp32"
        ),
        title_justify="left",
    )
    for col in (
        "candidate",
        "verdict",
        "max loss diff",
        "output SQNR dB",
        "grad SQNR dB",
        "skipped",
        "first non-finite (fwd / bwd)",
        "keep_fp32 fix",
    ):
        table.add_column(col, justify="left" if col in ("candidate", "verdict", "keep_fp32 fix") else "right")
    for c in result.candidates:
        nonfinite = " / ".join(x or "-" for x in (c.first_nonfinite_forward, c.first_nonfinite_backward))
        found = c.fix_keep_fp32 or [f"bf16:{e}" for e in c.fix_keep_bf16]
        fix = ", ".join(found) + (" (verified)" if c.fix_verified else " (unverified)") if found else ""
        table.add_row(
            c.label,
            Text(c.verdict + (" (predicted)" if c.predicted else ""), style=rich_style(c.verdict)),
            fmt_pct(c.max_rel_loss_diff, 2),
            fmt_db(c.output_sqnr_db, unit=False),
            fmt_db(c.total_grad_sqnr_db, unit=False),
            str(c.skipped_steps) if c.verdict != "unsupported" else "",
            nonfinite if c.verdict != "unsupported" else "",
            fix,
        )
    parts: list[Any] = [table]
    if result.chaos_floor_rel_loss_diff is not None:
        parts.append(
            Text(
                f"chaos floor: two fp32 runs whose weights differ by 1 part in 2^20 drift "
                f"{result.chaos_floor_rel_loss_diff:.2%} apart in {result.steps} steps; candidates may drift "
                "a few times that"
                + "".join(
                    f"; runs one {fmt} rounding apart {_max_rel(losses, result.reference_losses):.2%} "
                    f"(the floor of the {fmt} candidates where further)"
                    for fmt, losses in result.format_floor_losses.items()
                )
                + ".",
                style="dim",
            )
        )
    if result.power:  # power first: more steps were checked than asked for
        parts.append(Text(f"power: {result.power}", style="yellow"))
    if result.reference_note:
        parts.append(Text(f"warning: {result.reference_note}", style="yellow"))
    for c in result.candidates:
        parts.append(Text(f"{c.label}: {c.reason}", style=rich_style(c.verdict)))
        if c.predicted:
            parts.append(Text(f"    {c.predicted}", style="dim"))
        if c.scaler_warmup_skips:
            scaler = (known_framework(c.candidate.framework) or Framework).scaler_name
            parts.append(
                Text(
                    f"    loss scale settled at {c.scales[0] if c.scales else '?'}: {scaler} skips "
                    f"{c.scaler_warmup_skips} start-up steps to get there from its initial scale (normal)",
                    style="dim",
                )
            )
        if c.evidence:
            parts.append(Text(f"    {c.evidence}", style="yellow"))
        # a low format's range is bf16's (dynamic scales): its headroom says nothing; its map does
        if c.verdict in ("fail", "at-risk") and c.run_headroom and not c.precision_map:
            for layer in c.run_headroom[:3]:
                kind = f" ({layer['type']})" if layer.get("type") else ""
                sides = [
                    f"{side} {fmt_bits(layer[f'{side}_headroom_bits'])} (step {layer[f'{side}_step']})"
                    for side in ("forward", "backward")
                    if layer.get(f"{side}_headroom_bits") is not None
                ]
                parts.append(
                    Text(
                        f"    least {layer['format']} headroom over the {len(c.losses)} checked steps: "
                        f"{layer['layer']}{kind}: {', '.join(sides)}"
                    )
                )
        if c.verdict in ("fail", "at-risk"):
            for layer in [] if c.run_headroom else c.worst_layers[:3]:
                # a Keras check records forward outputs only, without the layer type
                kind = f" ({layer['type']})" if layer.get("type") else ""
                backward = layer.get("backward_headroom_bits")
                parts.append(
                    Text(
                        f"    least {layer['format']} headroom: {layer['layer']}{kind}: "
                        f"forward {fmt_bits(layer['forward_headroom_bits'])}"
                        + (f", backward {fmt_bits(backward)}" if backward is not None else "")
                    )
                )
            if c.fix_keep_bf16 and c.fix_verified:
                parts.append(Text(f"    fix: {map_snippet(c)}  ({c.fix_note})", style="bold"))
            elif c.fix_keep_fp32 and c.fix_verified:
                parts.append(Text(f"    fix: {fix_snippet(c)}  ({c.fix_note})", style="bold"))
            elif c.fix_note:
                parts.append(Text(f"    {c.fix_note}"))
            if c.suggestion:
                parts.append(Text(f"    suggestion: {c.suggestion}"))
        if c.precision_map:
            parts += [Text(f"    {line}", style="dim") for line in map_lines(c)]
    return Group(*parts)


def map_snippet(c: CandidateCheck) -> str:
    """The verified candidate, its own options (channels_last, keep_fp32) and the map, in one line."""
    fixed = replace(c.candidate, keep_bf16=(*c.candidate.keep_bf16, *c.fix_keep_bf16))
    return (known_framework(fixed.framework) or Framework()).map_snippet(fixed)


def map_lines(c: CandidateCheck) -> list[str]:
    """The precision map in figures: how much of the step runs in the format, and which layers the
    roofline says gain nothing from it (a prediction from the shapes)."""
    pm = c.precision_map or {}
    fmt, share, whole = pm.get("format"), pm.get("low_share_mapped", 0.0), pm.get("low_share_whole", 0.0)
    if pm.get("map"):
        lines = [
            f"{share:.0%} of the step's FLOPs in {fmt} under keep_bf16={pm['map']} ({whole:.0%} without it)"
        ]
    else:
        lines = [f"{whole:.0%} of the step's FLOPs in {fmt} (the rest: Linears it cannot take, other ops)"]
    layers = [x for x in pm.get("layers") or [] if x["low_directions"]]  # those still in the format
    if layers:
        worst = min(
            layers, key=lambda x: x["operand_sqnr_db"] if x["operand_sqnr_db"] is not None else math.inf
        )
        lines.append(
            f"worst GEMM in {fmt}: {worst['name']} "
            f"({fmt_db(worst['operand_sqnr_db'])} SQNR with quantised operands)"
        )
        speeds = ", ".join(f"{x['name']} {x['predicted_speedup']:.2f}x" for x in layers[:6])
        more = f" (+{len(layers) - 6} more in the JSON)" if len(layers) > 6 else ""
        lines.append(f"predicted on {pm.get('gpu')} (roofline, not measured): {speeds}{more}")
    if pm.get("no_gain"):
        lines.append(
            f"no gain predicted on {pm.get('gpu')} for {', '.join(pm['no_gain'][:6])}: their casts cost more "
            "than their GEMMs save there; keeping them in bf16 costs no accuracy"
        )
    return lines


def figure(result: CheckResult) -> Any:
    """Loss curves over the fp32 reference, their relative difference, and per-layer headroom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig = plt.figure(figsize=(12, 11.5))
    grid = fig.add_gridspec(3, 2, height_ratios=(1, 1.1, 1.1))
    ax_loss, ax_diff = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_head = fig.add_subplot(grid[1, :])
    ax_run = fig.add_subplot(grid[2, :])

    steps = range(len(result.reference_losses))
    ax_loss.plot(steps, result.reference_losses, color="black", linewidth=2.5, label="fp32 reference")
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn_limits: set[float] = set()
    for n, c in enumerate(c for c in result.candidates if c.losses):
        color = palette[n % len(palette)]
        style = "-" if c.verdict == "pass" else "--"
        finite = [(i, v) for i, v in enumerate(c.losses) if math.isfinite(v)]
        if finite:
            ax_loss.plot(
                *zip(*finite, strict=True),
                style,
                color=color,
                marker="o",
                markersize=3,
                label=f"{c.label} ({c.verdict})",
            )
        bad = [i for i, v in enumerate(c.losses) if not math.isfinite(v)]
        if bad:
            top = max(result.reference_losses)
            ax_loss.scatter(
                bad, [top] * len(bad), marker="x", color=color, zorder=5, label=f"{c.label}: loss non-finite"
            )
        diffs = [(i, max(d, 1e-9)) for i, d in enumerate(c.rel_loss_diff) if math.isfinite(d)]
        if diffs:
            ax_diff.semilogy(
                *zip(*diffs, strict=True), style, color=color, marker="o", markersize=3, label=c.label
            )
        limit = c.allowed_rel_loss_diff
        if limit and round(limit, 6) not in drawn_limits:  # candidates often share one allowance
            drawn_limits.add(round(limit, 6))
            ax_diff.axhline(limit, color=color, linestyle=":", label=f"allowed ({c.label})")
    floors = [(result.chaos_floor_losses, "-", "fp32 vs fp32 (weights off by 2^-20)")] + [
        (losses, "--", f"fp32 vs fp32 (weights off by one {fmt} rounding)")
        for fmt, losses in result.format_floor_losses.items()
    ]
    for losses, line, label in floors:  # the runs the allowances come from
        floor = [(i, max(d, 1e-9)) for i, d in _rel_diffs(losses, result.reference_losses)]
        if floor:
            ax_diff.semilogy(
                *zip(*floor, strict=True), line, color="gray", linewidth=3, alpha=0.4, label=label
            )
    ax_loss.set_title("training loss (same weights and batches)")
    ax_loss.set_xlabel("step")
    ax_loss.legend(fontsize=7)
    ax_diff.set_title("relative loss difference to fp32 (dotted: allowed)")
    ax_diff.set_xlabel("step")
    if ax_diff.lines:
        ax_diff.legend(fontsize=7)

    # fp16 is the format whose range matters (bf16 shares fp32's exponent range, see the text).
    layers = result.reference_layers
    x = list(range(len(layers)))
    fwd = [_nan(layer["forward_headroom_bits"].get("fp16")) for layer in layers]
    bwd = [_nan(layer.get("backward_headroom_bits", {}).get("fp16")) for layer in layers]
    ax_head.plot(x, fwd, "o", color="#d62728", markersize=4, label="activations (forward)")
    ax_head.plot(x, bwd, "x", color="#1f77b4", markersize=4, label="gradients (backward, unscaled)")
    ax_head.axhline(0, color="black", linewidth=1)
    ax_head.axhspan(-40, 0, color="#d62728", alpha=0.08)
    ax_head.text(0, -1.5, "overflows fp16 (shaded)", fontsize=8, va="top")
    ranked = sorted((h, i) for i, h in enumerate(fwd) if math.isfinite(h))[:3]
    for h, i in ranked:
        ax_head.annotate(layers[i]["layer"], (i, h), fontsize=7, xytext=(4, 4), textcoords="offset points")
    shown = [h for h in fwd + bwd if math.isfinite(h)]
    if shown:
        ax_head.set_ylim(min(-4.0, min(shown) - 2), max(shown) + 4)
    bf16 = [h for layer in layers for h in (layer["forward_headroom_bits"].get("bf16"),) if h is not None]
    bf16_note = f"; bf16 keeps >= {min(bf16):.0f} bits everywhere" if bf16 else ""
    ax_head.set_title(f"fp16 headroom per layer in the fp32 reference: log2(65504 / max |value|){bf16_note}")
    ax_head.set_xlabel("module, in forward execution order")
    ax_head.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_head.set_ylabel("headroom (bits)")
    ax_head.legend(fontsize=7)
    headroom_over_steps(ax_run, result, palette)
    fig.suptitle(f"mixprec check: {result.workload} on {result.device}", fontsize=11)
    fig.tight_layout()
    return fig


# The run panel shows this many (candidate, layer) lines at most: the closest to their format's limit.
RUN_LINES = 4
FAR_BITS = 24


def run_lines(result: CheckResult) -> list[tuple[CandidateCheck, dict[str, Any]]]:
    """The (candidate, least-headroom layer) pairs worth a line: failing and at-risk candidates
    first, then the rest by how little headroom their worst layer kept."""

    def lowest(layer: dict[str, Any]) -> float:
        bits = [layer.get(f"{side}_headroom_bits") for side in ("forward", "backward")]
        return min((b for b in bits if b is not None), default=math.inf)

    pairs = [(c, layer) for c in result.candidates for layer in c.run_headroom[:2] if c.series]
    pairs.sort(key=lambda p: (p[0].verdict not in ("fail", "at-risk"), lowest(p[1])))
    # a layer far from its limit (bf16's 128 bits beside fp16's 5) would flatten the ones near it
    closest = min((lowest(layer) for _, layer in pairs), default=math.inf)
    return [p for p in pairs if lowest(p[1]) <= closest + FAR_BITS][:RUN_LINES]


def trend_curve(risk: dict[str, Any], last: int, points: int = 40) -> tuple[list[float], list[float]]:
    """The headroom a predicted trend follows from the last checked step to its crossing, in the
    shape it was fitted with (linear growth in value is a curve in bits)."""
    start, end, h0 = float(last), float(risk["step"]), float(risk["headroom_bits"])
    ts = [start + (end - start) * i / (points - 1) for i in range(points)]
    if risk["shape"] == "linear":
        v0 = 2.0**-h0  # values as a fraction of the limit
        bits = [-math.log2(v0 + (1 - v0) * (t - start) / max(end - start, 1e-9)) for t in ts]
    elif risk["shape"] == "power":
        span = max(math.log2(end + 1) - math.log2(start + 1), 1e-9)
        bits = [h0 * (1 - (math.log2(t + 1) - math.log2(start + 1)) / span) for t in ts]
    else:  # exponential: a straight line in bits
        bits = [h0 * (1 - (t - start) / max(end - start, 1e-9)) for t in ts]
    return ts, bits


def headroom_over_steps(ax: Any, result: CheckResult, palette: list[str]) -> None:
    """Headroom per checked step of the layers closest to their format's limit, each candidate in
    its own format; dashed, the trend that predicted an at-risk verdict, out to its crossing."""
    from mixprec.numerics.trend import headroom_bits

    pairs = run_lines(result)
    if not pairs:
        ax.text(0.5, 0.5, "no per-step ranges recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    for n, (c, layer) in enumerate(pairs):
        color = palette[(n + 3) % len(palette)]
        fmt = layer["format"]
        series = next(s for s in c.series if s["name"] == layer["layer"])
        for side, mark in (("forward", "o-"), ("backward", "x:")):
            points = [
                (t, b)
                for t, v in enumerate(series.get(side) or [])
                if (b := headroom_bits(v, fmt)) is not None
            ]
            points = [(t, max(b, -8.0)) for t, b in points]  # an overflow (-inf) drawn at the floor
            if points:
                ax.plot(
                    *zip(*points, strict=True),
                    mark,
                    color=color,
                    markersize=3,
                    label=f"{c.label}: {layer['layer']} {side} ({fmt})",
                )
        risk = (c.outlook or {}).get("at_risk") or {}
        if risk.get("layer") == layer["layer"] and risk.get("direction") in ("forward", "backward"):
            last = len(series.get(risk["direction"]) or []) - 1
            ts, bits = trend_curve(risk, last)
            ax.plot(
                ts,
                bits,
                "--",
                color=color,
                linewidth=1.5,
                label=f"{c.label}: its {risk['shape']} trend, predicted to overflow at step {risk['step']}",
            )
            ax.annotate(
                f"step {risk['step']}",
                (risk["step"], 0.0),
                fontsize=8,
                xytext=(-10, 6),
                textcoords="offset points",
                ha="right",
            )
    ax.axhline(0, color="black", linewidth=1)
    ax.set_title(
        "headroom over the checked steps, layers closest to their limit: log2(format max / max |value|)"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("headroom (bits)")
    ax.legend(fontsize=7)


def plot(path: str | os.PathLike[str], result: CheckResult) -> Path:
    """The chart of :func:`figure`, written to ``path`` (its suffix picks png, svg or pdf)."""
    return save_figure(figure(result), path, dpi=110)


def png(result: CheckResult) -> bytes:
    """The chart of :func:`figure` as PNG bytes."""
    return figure_bytes(figure(result), "png", dpi=110)


def _rel_diffs(losses: list[float], reference: list[float]) -> list[tuple[int, float]]:
    """(step, relative distance of ``losses`` from ``reference``) over their finite steps."""
    return [
        (i, abs(a - b) / max(abs(b), 1e-12))
        for i, (a, b) in enumerate(zip(losses, reference, strict=False))
        if math.isfinite(a + b)
    ]


def _max_rel(losses: list[float], reference: list[float]) -> float:
    """The largest relative distance of ``losses`` from ``reference`` over their finite steps."""
    return max((d for _, d in _rel_diffs(losses, reference)), default=0.0)


def _nan(x: float | None) -> float:
    return math.nan if x is None else x
