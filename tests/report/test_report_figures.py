"""One definition per figure: the speed chart's bars and labels are the table's paired speedups,
and memory a pick uses beyond strict fp32 is never shown as "saved"."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mixprec.policy import Candidate
from mixprec.report import bench as bench_report
from mixprec.report import view as report_view
from mixprec.tuning import TuneResult

OLD_FILE = Path(__file__).parent / "data" / "tune-resnet50-schema1.json"  # as 0.1 wrote it


@pytest.fixture(scope="module")
def result(tiny_tune_result) -> TuneResult:
    return tiny_tune_result


def test_every_bar_is_its_rows_paired_speedup(result):
    import matplotlib.pyplot as plt

    fig = bench_report.figure(result.bench)
    try:
        ax = fig.axes[0]
        rows = [r for r in result.bench.rows if not r.baseline_repeat and r.status != "unsupported"]
        widths = [bar.get_width() for bar in ax.patches]
        assert widths == [pytest.approx(bench_report.chart_speedup(r)) for r in rows]
        measured = [r for r in rows if r.status == "ok" and r.speedup_vs_fp32]
        assert measured
        texts = [t.get_text() for t in ax.texts]
        for row in measured:  # the label starts with the same figure the bar is drawn to
            assert any(t.startswith(f" {row.speedup_vs_fp32:.2f}x") for t in texts), (row.label, texts)
        assert "paired" in ax.get_xlabel()
    finally:
        plt.close(fig)


def test_every_title_and_label_of_the_speed_chart_fits_in_the_figure():
    """The memory panel's title carries how memory was measured (a long sentence for isolated
    candidates); drawn on one line it ran off the figure's right edge."""
    import matplotlib.pyplot as plt

    old = TuneResult.from_dict(json.loads(OLD_FILE.read_text(encoding="utf-8")))  # ResNet-50's rows
    method = "peak RSS of the isolated candidate process minus its RSS before building"
    measured = [replace(r, memory_method=method) for r in old.bench.measured]
    step = Candidate("bf16-mixed", channels_last=True, compile="default", compile_scope="step")
    ok = next(r for r in measured if r.status == "ok" and not r.baseline_repeat)
    measured.append(replace(ok, candidate=step))  # the longest label tune writes by default
    fig = bench_report.figure(replace(old.bench, measured=measured))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        edge = fig.bbox
        texts = [ax.title for ax in fig.axes] + [ax.xaxis.label for ax in fig.axes] + list(fig.texts)
        for text in texts:
            box = text.get_window_extent(renderer)
            assert edge.x0 <= box.x0 and box.x1 <= edge.x1, (text.get_text(), box.x1, edge.x1)
    finally:
        plt.close(fig)


def test_memory_a_pick_uses_beyond_fp32_is_not_called_saved(result):
    rec = result.recommendation
    more = replace(result, recommendation=replace(rec, memory_saved_bytes=-98_700_000))
    cards = {c.name: c for c in report_view.build(more).sections[0].body.cards}
    assert "memory saved" not in cards
    assert cards["memory used"].value.endswith(" more") and "-" not in cards["memory used"].value
    less = replace(result, recommendation=replace(rec, memory_saved_bytes=98_700_000))
    cards = {c.name: c for c in report_view.build(less).sections[0].body.cards}
    assert "memory saved" in cards and "memory used" not in cards


def test_a_bf16_run_has_no_empty_loss_scale_panel():
    import matplotlib.pyplot as plt

    import mixprec
    from mixprec.monitor.train import train
    from mixprec.report import train as train_report

    result = train(mixprec.load_workload("mlp", hidden=32, depth=1), "bf16-mixed", 12)
    assert not result.scales and not result.skipped  # bf16 has no loss scaler
    fig = train_report.figure(result)
    try:
        labels = [a.get_ylabel() for a in fig.axes]
        assert "loss scale" not in labels and labels[0] == "loss"
        assert all(a.lines or a.collections for a in fig.axes), labels  # every panel draws something
    finally:
        plt.close(fig)
