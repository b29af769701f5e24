"""Where the budget went (the phases bar of the report and the terminal's time line), and a
candidates table that fits a 1400 px window: long labels wrap after '+', long reasons are shortened
at a word with the whole text on demand. Rendered from the committed schema-1 tune file, with
phases and long rows added."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from importlib import resources
from pathlib import Path

import pytest
from rich.console import Console

from mixprec.policy import Candidate
from mixprec.report import format as fmt
from mixprec.report import html as report_html
from mixprec.report import view as report_view
from mixprec.report.tune import candidate_table, summary
from mixprec.report.view_types import CANDIDATE_COLUMNS, WHY_CHARS
from mixprec.status import Status
from mixprec.tuning import TuneResult
from mixprec.tuning.decide import Ranked

# a schema-1 tune file as 0.1 wrote it (a copy, so regenerating benchmarks/results leaves it be)
OLD_FILE = Path(__file__).parent / "data" / "tune-resnet50-schema1.json"
# seconds per phase, out of order, with one too short to show
PHASES = {"other": 4.6, "speed": 120.4, "numerics": 80.2, "compile": 60.0, "race": 20.0, "prediction": 0.2}
LONG_LABEL = "bf16-mixed+cl+fp32[head]+compile-step:max-autotune"
WINDOW = 1400


@pytest.fixture(scope="module")
def old_result() -> TuneResult:
    return TuneResult.from_dict(json.loads(OLD_FILE.read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def timed(old_result) -> TuneResult:
    """The old file with phases, a 300 s budget and a compiled candidate with a long label."""
    cand = Candidate(
        "bf16-mixed", channels_last=True, keep_fp32=("head",), compile="max-autotune", compile_scope="step"
    )
    assert cand.label == LONG_LABEL
    reason = "numerics not checked: a faster candidate passed first, or the budget ran out before it"
    ranked = [*old_result.ranked, Ranked(cand, Status.UNCHECKED, reason)]
    return dataclasses.replace(old_result, ranked=ranked, budget_s=300.0, phases=dict(PHASES))


def _css() -> str:
    return resources.files("mixprec.report").joinpath("static", "report.css").read_text(encoding="utf-8")


def _terminal(renderable) -> str:
    console = Console(width=240, record=True, force_terminal=False)
    console.print(renderable)
    return console.export_text()


# ---------------------------------------------------------------------------------------------
# Where the budget went


def test_budget_bar_segments_in_phase_order_then_the_unused_budget(timed):
    bar = report_view.budget_view(timed)
    assert bar is not None and bar.caption == "Where the 300 s budget went"
    names = [s.name for s in bar.segments]
    assert names == ["speed", "numerics", "compile", "race", "other", "unused"]  # prediction: 0 s
    assert [s.seconds for s in bar.segments] == ["120 s", "80 s", "60 s", "20 s", "5 s", "15 s"]
    assert [s.share for s in bar.segments] == ["40%", "27%", "20%", "7%", "2%", "5%"]
    assert [s.unused for s in bar.segments] == [False] * 5 + [True]
    assert sum(s.width for s in bar.segments) == pytest.approx(100)
    assert bar.segments[0].width == pytest.approx(100 * 120.4 / 300)
    assert bar.segments[1].title == "numerics: 80 s, 27% of the 300 s budget"
    assert bar.label.startswith("Where the 300 s budget went: speed 120 s, numerics 80 s,")


def test_budget_bar_in_html_and_markdown(timed):
    page = report_html.render_html(timed)
    bar = re.search(r'<span class="budget-bar" role="img" aria-label="([^"]+)">(.*?)</span>\n', page)
    assert bar is not None
    segments = re.findall(r'<span class="([\w-]+)" style="width: ([\d.]+)%" title="([^"]+)"></span>', bar[2])
    assert [(key, title) for key, _, title in segments] == [
        ("phase-speed", "speed: 120 s, 40% of the 300 s budget"),
        ("phase-numerics", "numerics: 80 s, 27% of the 300 s budget"),
        ("phase-compile", "compile: 60 s, 20% of the 300 s budget"),
        ("phase-race", "race: 20 s, 7% of the 300 s budget"),
        ("phase-other", "other: 5 s, 2% of the 300 s budget"),
        ("unused", "unused: 15 s, 5% of the 300 s budget"),
    ]
    assert sum(float(width) for _, width, _ in segments) == pytest.approx(100, abs=0.05)
    legend = re.search(r'<ul class="budget-legend">(.*?)</ul>', page)
    assert legend is not None
    assert (
        '<span class="swatch phase-numerics"></span>numerics <b>80 s</b> <span class="share">(27%)</span>'
        in (legend[1])
    )
    assert page.index('class="meta"') < page.index('class="budget"') < page.index('class="verdict')
    css = _css()
    for key, _, _ in segments:  # every phase tuned has its colour
        assert f".budget .{key} {{ background:" in css
    md = report_html.render_markdown(timed)
    assert (
        "\nWhere the 300 s budget went: speed 120 s (40%) · numerics 80 s (27%) · compile 60 s (20%) · "
        "race 20 s (7%) · other 5 s (2%) · unused 15 s (5%)\n\n> **"
    ) in md


def test_no_budget_bar_for_an_old_file(old_result):
    assert old_result.phases == {}
    assert report_view.budget_view(old_result) is None and report_view.build(old_result).budget is None
    assert 'class="budget' not in report_html.render_html(old_result)
    assert "budget went" not in report_html.render_markdown(old_result)
    assert "time:" not in _terminal(summary(old_result))


def test_budget_bar_without_a_budget_or_over_it(timed):
    unknown = report_view.budget_view(dataclasses.replace(timed, budget_s=0.0))
    assert unknown is not None and unknown.caption == "Where the time went"
    assert "unused" not in [s.name for s in unknown.segments]
    assert unknown.segments[0].title == "speed: 120 s, 42% of the time spent"
    over = report_view.budget_view(dataclasses.replace(timed, budget_s=200.0))
    assert over is not None and "unused" not in [s.name for s in over.segments]
    assert sum(s.width for s in over.segments) == pytest.approx(100)  # the bar is full, not wider
    assert over.segments[0].share == "60%"  # shares stay shares of the budget


def test_terminal_time_line(timed, old_result):
    text = _terminal(summary(timed))
    assert "time: speed 120 s, numerics 80 s, compile 60 s, race 20 s, other 5 s of 300 s" in text
    failed = dataclasses.replace(timed, recommendation=None)  # printed when nothing passed too
    assert "time: speed 120 s," in _terminal(summary(failed))
    assert fmt.fmt_phases(PHASES) == "speed 120 s, numerics 80 s, compile 60 s, race 20 s, other 5 s"
    assert fmt.fmt_phases({}, 300) == "" and fmt.fmt_phases({"x": "junk", "y": 0.1}) == ""
    assert fmt.phase_seconds({"late": 3.0, "speed": 1.0}) == (("speed", 1.0), ("late", 3.0))


# ---------------------------------------------------------------------------------------------
# Reasons shortened at a word


def test_shorten_cuts_at_a_word_boundary():
    reason = (
        "step 0 still running after 3.3 s, far slower than the best candidate so far (best so far 598 ms)"
    )
    short = fmt.shorten(reason, 90)
    assert (
        short == "step 0 still running after 3.3 s, far slower than the best candidate so far (best so far…"
    )
    assert len(short) <= 90 and reason.startswith(short[:-1]) and reason[len(short) - 1] == " "
    assert fmt.shorten("fp32 numerics (layout only)", 90) == "fp32 numerics (layout only)"
    assert fmt.shorten("a  b\nc", 90) == "a b c"
    assert fmt.shorten("one, two; three", 12) == "one, two…"  # no dangling punctuation
    assert fmt.shorten("x" * 20, 8) == "x" * 7 + "…"  # a single word longer than the width


def test_terminal_reason_cut_at_a_word_with_an_ellipsis(old_result):
    text = _terminal(candidate_table(old_result))
    long = [r.reason for r in old_result.ranked if len(r.reason) > 90]
    assert long
    for reason in long:
        short = fmt.shorten(reason, 90)
        assert short.endswith("…") and reason[len(short) - 1] == " "
        assert short in text and reason[:90] not in text  # not cut mid-word as before
    assert "the strict fp32 reference" in text


# ---------------------------------------------------------------------------------------------
# The candidates table fits the page


def _css_px(css: str, selector: str, prop: str) -> int:
    block = re.search(re.escape(selector) + r"\s*\{([^}]*)\}", css)
    assert block is not None, selector
    value = re.search(rf"(?<![\w-]){prop}:\s*(\d+)px", block[1])
    assert value is not None, (selector, prop)
    return int(value[1])


def test_candidates_table_css_fits_a_1400px_window():
    css = _css()
    assert all(int(px) <= WINDOW for px in re.findall(r"min-width:\s*(\d+)px", css))
    table = re.search(r"table\.candidates \{([^}]*)\}", css)
    assert table is not None and "table-layout: fixed" in table[1]
    # the page's content width in a 1400 px window (less a 15 px scrollbar)
    main = min(_css_px(css, "main", "max-width"), WINDOW - 15)
    padding = re.search(r"main \{[^}]*padding: \d+px (\d+)px", css)
    assert padding is not None
    content = main - 2 * int(padding[1])
    fixed = [_css_px(css, f"col.{c.key}", "width") for c in CANDIDATE_COLUMNS if c.key != "why"]
    assert len(fixed) == len(CANDIDATE_COLUMNS) - 1  # every column but "why" has its width
    assert content - sum(fixed) >= 300  # what is left for "why": two lines of WHY_CHARS characters
    assert _css_px(css, "table.candidates", "min-width") <= content
    candidate = re.search(r"td\.candidate \{([^}]*)\}", css)
    assert candidate is not None and "nowrap" not in candidate[1]
    why = re.search(r"td\.why \{([^}]*)\}", css)
    assert why is not None and "min-width" not in why[1]  # nothing pushes the table wider


def test_candidates_markup_long_label_wraps_and_long_reason_is_shortened(timed):
    page = report_html.render_html(timed)
    section = page[page.index('<section id="candidates">') : page.index('<section id="charts">')]
    assert '<table class="candidates">' in section
    cols = re.findall(r'<col class="([\w-]+)">', section)
    assert cols == [c.key for c in CANDIDATE_COLUMNS]
    wrapped = "bf16-mixed+<wbr>cl+<wbr>fp32[head]+<wbr>compile-step:<wbr>max-autotune"
    assert f"{wrapped}</td>" in section and wrapped.replace("<wbr>", "") == LONG_LABEL
    assert report_view.label_parts("fp32") == ()
    whys = [report_view.candidate_row(r).cells[-1] for r in timed.ranked]
    long = [c for c in whys if c.full]
    assert long and len(long) < len(whys)
    for cell in long:
        assert len(cell.full) > WHY_CHARS and cell.text == fmt.shorten(cell.full, WHY_CHARS)
    details = re.findall(
        r'<td class="why"><details><summary title="([^"]*)"><span class="short">([^<]*)</span>'
        r'<span class="full">([^<]*)</span></summary></details></td>',
        section,
    )
    assert [tuple(html.unescape(x) for x in d) for d in details] == [(c.full, c.text, c.full) for c in long]
    short_why = next(c.text for c in whys if not c.full)
    assert f'<td class="why">{html.escape(short_why)}</td>' in section  # short reasons as they are
    md = report_html.render_markdown(timed)
    for cell in long:  # Markdown keeps the whole reason
        assert report_html.md(cell.full) in md
