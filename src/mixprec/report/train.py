"""Presentation of a monitored run (`mixprec train`): the findings as lines, and a chart of the
loss, the loss scale and the headroom of the layers closest to their format's limit."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.text import Text

from mixprec.monitor.train import TrainResult
from mixprec.report.figure import save_figure


def train_report(result: TrainResult) -> Group:
    final = result.final_policy
    label = final["name"] + (f" keep_fp32={final['keep_fp32']}" if final.get("keep_fp32") else "")
    last = result.losses[-1] if result.losses else float("nan")
    lines = [
        Text(
            f"{result.workload}: {len(result.losses)} of {result.steps} steps under {result.policy}, "
            f"{len(result.skipped)} skipped, final loss {last:.4g}"
        )
    ]
    for f in result.findings:
        where = f" [{f['module']}]" if f.get("module") else ""
        style = "green" if f["kind"] in ("rescue", "schedule") else "yellow"
        lines.append(Text(f"step {f['step']}: {f['kind']}{where}: {f['message']}", style=style))
    if result.stopped:
        lines.append(Text(f"stopped: {result.stopped}", style="red"))
    verdict = "healthy" if result.healthy else "not healthy"
    lines.append(Text(f"the run ended {verdict}; the policy for the next run: {label}", style="bold"))
    return Group(*lines)


def figure(result: TrainResult) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mixprec.numerics.trend import LayerSeries, headroom_bits, least_headroom

    fmt = result.range_format
    series = [LayerSeries.from_dict(s) for s in result.series]
    # no empty panels: the loss scale only where a scaler ran or a step was skipped, the headroom
    # only where ranges were sampled
    panels = ["loss"]
    if result.scales or result.skipped:
        panels.append("scale")
    if fmt and series:
        panels.append("headroom")
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.4 * len(panels)), sharex=True, squeeze=False)
    ax = dict(zip(panels, axes[:, 0], strict=True))
    ax_loss = ax["loss"]
    finite = [(i, v) for i, v in enumerate(result.losses) if math.isfinite(v)]
    if finite:
        ax_loss.plot(*zip(*finite, strict=True), linewidth=1, color="black")
    bad = [i for i, v in enumerate(result.losses) if not math.isfinite(v)]
    if bad:
        top = max((v for _, v in finite), default=1.0)
        ax_loss.scatter(bad, [top] * len(bad), marker="x", color="red", label="loss not finite")
        ax_loss.legend(fontsize=8)
    ax_loss.set_ylabel("loss")
    if "scale" in ax:
        ax_scale = ax["scale"]
        if result.scales:
            ax_scale.semilogy(*zip(*result.scales, strict=True), color="#1f77b4")
        if result.skipped:
            skipped = [1] * len(result.skipped)
            ax_scale.scatter(result.skipped, skipped, marker="|", color="red", label="skipped")
            ax_scale.legend(fontsize=8)
        ax_scale.set_ylabel("loss scale")
    if "headroom" in ax and fmt:
        ax_head = ax["headroom"]
        worst = {row["layer"] for row in least_headroom(series, fmt, n=4)}
        for s in series:
            if s.name not in worst:
                continue
            points = [
                (step, b)
                for step, v in zip(result.sample_steps, s.forward, strict=False)
                if (b := headroom_bits(v, fmt)) is not None
            ]
            points = [(t, max(b, -4.0)) for t, b in points]
            if points:
                ax_head.plot(*zip(*points, strict=True), "o-", markersize=3, label=f"{s.name} ({fmt})")
        ax_head.axhline(0, color="black", linewidth=1)
        ax_head.legend(fontsize=8)
        ax_head.set_ylabel("headroom (bits)")
    axes[-1, 0].set_xlabel("step")
    for f in result.findings:
        for panel in ax.values():
            panel.axvline(
                f["step"], color="green" if f["kind"] == "rescue" else "orange", alpha=0.4, linewidth=1
            )
    ax_loss.set_title(
        f"mixprec train: {result.workload} under {result.policy} (vertical lines: findings, rescues)"
    )
    fig.tight_layout()
    return fig


def plot(path: str | os.PathLike[str], result: TrainResult) -> Path:
    return save_figure(figure(result), path, dpi=100)
