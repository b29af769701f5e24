"""The tune report: HTML and Markdown from one view of a real TuneResult (the `tiny_tune_result`
fixture: a tune of the mlp workload on the CPU), the schema-1 file in benchmarks/results, and
the number formatting they share."""

from __future__ import annotations

import copy
import dataclasses
import html
import json
import re
from pathlib import Path

import pytest

from mixprec.cli import main
from mixprec.linting import Finding, MeasuredGain
from mixprec.report import format as fmt
from mixprec.report import html as report_html
from mixprec.report import view as report_view
from mixprec.report.jsonio import write_json
from mixprec.status import Status, tone
from mixprec.tuning import TuneResult

# a schema-1 tune file as 0.1 wrote it (a copy, so regenerating benchmarks/results leaves it be)
OLD_FILE = Path(__file__).parent / "data" / "tune-resnet50-schema1.json"
HEADINGS = ["Recommendation", "Candidates", "Charts", "Lint findings", "Exports", "Environment"]
EVIL = '<script>alert("x")</script>'


@pytest.fixture(scope="module")
def result(tiny_tune_result) -> TuneResult:
    return tiny_tune_result


@pytest.fixture(scope="module")
def written(result, tmp_path_factory) -> dict[str, Path]:
    """One full report with the charts drawn from the result (matplotlib: the slow part)."""
    return report_html.write_report(result, tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def old_result() -> TuneResult:
    return TuneResult.from_dict(json.loads(OLD_FILE.read_text(encoding="utf-8")))


def _h2(page: str) -> list[str]:
    return re.findall(r"<h2>(.*?)</h2>", page)


def _charts(written: dict[str, Path]) -> dict[str, Path]:
    return {k: v for k, v in written.items() if k not in ("html", "markdown")}


def _md_h2(md: str) -> list[str]:
    return re.findall(r"^## (.*)$", md, flags=re.M)


def _recommended(result: TuneResult):
    return next(r for r in result.ranked if r.status == Status.RECOMMENDED)


def _findings() -> list[dict]:
    gain = MeasuredGain(layer_before_ms=1.2, layer_after_ms=0.9, step_before_ms=5.0, step_after_ms=4.79)
    return [
        Finding(
            "MP101",
            "misaligned",
            "warning",
            "net.0",
            "in_features=100 is not a multiple of 8",
            "pad to 104",
            measured=gain,
        ).to_dict(),
        Finding("MP201", "channels-last", "info", None, "model runs NCHW", "use channels_last").to_dict(),
    ]


# ---------------------------------------------------------------------------------------------
# The report of a real tune


def test_write_report_files_and_sections_in_order(written, result):
    assert written["html"].name == "index.html" and written["markdown"].name == "report.md"
    checked = result.check is not None and bool(result.check.candidates)
    assert list(_charts(written)) == ["bench", "check"][: 1 + checked]
    page = written["html"].read_text(encoding="utf-8")
    assert _h2(page) == HEADINGS
    assert page.index("<header>") < page.index('class="verdict') < page.index("<h2>") < page.index("<footer>")
    assert f"<h1>{result.workload}</h1>" in page
    md = written["markdown"].read_text(encoding="utf-8")
    assert _md_h2(md) == HEADINGS
    assert md.startswith(f"# mixprec tune report: {result.workload}\n")
    assert md.index("\n> **") < md.index("\n## Recommendation")
    assert "\n\n\n" not in re.sub(r"^```.*?^```", "code", md, flags=re.M | re.S)  # outside the exports


def test_html_and_markdown_come_from_the_same_view(result):
    view = report_view.build(result)
    assert [s.title for s in view.sections] == HEADINGS
    page, md = report_html.render_html(result), report_html.render_markdown(result)
    tone_, verdict = report_view.verdict_line(result)
    assert f'<div class="verdict {tone_}">{html.escape(verdict, quote=True)}</div>' in page
    assert f"> **{report_html.md(verdict)}**" in md
    for section in view.sections:
        for text in filter(None, (section.lead, section.empty)):
            assert html.escape(text) in page and report_html.md(text) in md
    for pair in view.meta:
        assert html.escape(pair.value) in page and report_html.md(pair.value) in md


def test_html_is_self_contained(written):
    page = written["html"].read_text(encoding="utf-8")
    imgs = re.findall(r"<img\b[^>]*>", page)
    assert len(imgs) == len(_charts(written)) >= 1  # bench, and check when a check ran
    for tag in imgs:
        assert re.search(r'src="data:image/png;base64,[A-Za-z0-9+/=]+"', tag), tag[:80]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "<link" not in page and "@import" not in page and "url(" not in page
    assert page.count("<style>") == 1 and "span.badge.best" in page  # report.css, inlined as is
    assert page.count("<script>") == 1 and "navigator.clipboard" in page  # report.js
    assert '"Segoe UI"' in page  # the CSS is not HTML-escaped


def test_markdown_charts_exist_next_to_it(written):
    md = written["markdown"].read_text(encoding="utf-8")
    refs = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert refs == [f"{name}.png" for name in _charts(written)]
    for ref in refs:
        png = written["markdown"].parent / ref
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert written[ref.removesuffix(".png")] == png


def test_candidates_table_with_the_recommended_row_marked(result):
    page = report_html.render_html(result)
    rec = _recommended(result)
    assert rec.candidate == result.recommendation.candidate
    marked = re.findall(r'<tr class="recommended">(.*?)</tr>', page)
    assert len(marked) == 1
    assert f"★</span> {html.escape(rec.label)}</td>" in marked[0].replace("<wbr>", "")
    assert '<span class="badge best">recommended</span>' in marked[0]
    rows = re.findall(r"<tr(?: class=\"recommended\")?><td class=\"candidate\">(.*?)</tr>", page)
    assert len(rows) == len(result.ranked)
    for ranked, row in zip(result.ranked, rows, strict=True):
        assert html.escape(ranked.label) in row.replace("<wbr>", "")  # a label may wrap after '+'
        assert f'<span class="badge {tone(ranked.status)}">{ranked.status}</span>' in row
        if ranked.row is not None and ranked.row.throughput:
            assert f'<td class="num">{fmt.fmt_throughput(ranked.row.throughput)}</td>' in row
            speedup = fmt.fmt_speedup_ci(ranked.row.speedup_vs_fp32, ranked.row.interval)
            assert f'<td class="num">{speedup}</td>' in row
            assert f'<td class="num">{fmt.fmt_bytes(ranked.row.peak_memory_bytes)}</td>' in row

    md = report_html.render_markdown(result).splitlines()
    columns = "candidate | status | samples/s | speedup vs fp32 | step ms median ± IQR | peak memory | MFU"
    head = md.index(f"| {columns} | compile | matmul/conv share of step | numerics | why |")
    assert md[head + 1] == "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|"
    body = md[head + 2 : head + 2 + len(result.ranked)]
    assert [line.count(" | ") for line in body] == [10] * len(result.ranked)
    assert [line for line in body if "★" in line] == [
        next(line for line in body if line.startswith(f"| **{report_html.md(rec.label)}** ★ | recommended |"))
    ]


def test_recommendation_cards(result, old_result):
    view = report_view.build(old_result)
    cards = {c.name: c for c in view.sections[0].body.cards}
    assert cards["speedup vs fp32"].value == "2.06x"
    assert cards["output SQNR"].value == "14.7 dB" and cards["output SQNR"].note == "limit ≥ -7.8 dB"
    assert cards["max loss diff"].value == "1.48%" and cards["max loss diff"].note == "limit ≤ 4.16%"
    assert cards["memory saved"].value == "272.6 MiB"
    page = report_html.render_html(result)
    rec = result.recommendation
    assert f'<div class="v">{fmt.fmt_speedup(rec.speedup_vs_fp32)}</div>' in page


def test_refused_exports_show_why(result):
    import dataclasses

    refused = dataclasses.replace(
        result,
        exports={k: v for k, v in result.exports.items() if k != "hf"},
        export_refusals={"hf": "the HF Trainer <cannot> do this"},
    )
    page = report_html.render_html(refused)
    assert (
        '<span class="badge bad">refused</span>' in page and "the HF Trainer &lt;cannot&gt; do this" in page
    )
    assert 'id="export-hf"' not in page
    assert "Refused: the HF Trainer" in report_html.render_markdown(refused)


def test_exports_present_and_equal_to_the_result(result, written):
    # 7 targets, each faithful or refused: a compiled or fused pick (tune may make one on a noisy
    # machine) is refused by the targets that cannot write torch.compile or the optimizer flag
    assert len(result.exports) + len(result.export_refusals) == 7 and {"mixprec", "pytorch"} <= set(
        result.exports
    )
    page = written["html"].read_text(encoding="utf-8")
    blocks = dict(
        re.findall(r'<pre id="export-([a-z0-9-]+)"><code[^>]*>(.*?)</code></pre>', page, flags=re.S)
    )
    assert list(blocks) == list(result.exports)
    for key, text in result.exports.items():
        assert html.unescape(blocks[key]) == text.rstrip()
        assert f'data-target="export-{key}"' in page  # its copy button
    md = written["markdown"].read_text(encoding="utf-8")
    fenced = re.findall(r"^### ([^\n]*)\n\nFaithful\.\n\n(`{3,})[a-z]*\n(.*?)\n\2$", md, flags=re.M | re.S)
    assert [body for _, _, body in fenced] == [text.rstrip() for text in result.exports.values()]
    assert [title for title, _, _ in fenced] == [report_view.EXPORT_TITLES[k] for k in result.exports]


def test_user_text_is_escaped(result):
    evil = copy.deepcopy(result)
    evil.workload = "<i>net</i>"
    evil.description = EVIL
    # the row's own notes cleared: what this machine's measurement adds to the cell (a pace that
    # moved over the sweep, say) would follow the reason, and the cell must end where the reason does
    quiet_row = dataclasses.replace(evil.ranked[1].row, notes=(), mfu_note="")
    evil.ranked[1] = dataclasses.replace(evil.ranked[1], reason=f"{EVIL} | cell\nbreak", row=quiet_row)
    evil.recommendation.reason = "a < b && c > d"
    evil.exports["pytorch"] = "if a < b:\n    x = '</pre>'\n"
    evil.lint = _findings()
    evil.lint[0]["module"] = "blocks.<b>0</b>&fc"
    page = report_html.render_html(evil)
    assert EVIL not in page and "<b>0</b>" not in page and "<i>net</i>" not in page
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page
    assert "<h1>&lt;i&gt;net&lt;/i&gt;</h1>" in page
    assert "blocks.&lt;b&gt;0&lt;/b&gt;&amp;fc" in page
    assert "a &lt; b &amp;&amp; c &gt; d" in page
    assert "x = &#39;&lt;/pre&gt;&#39;" in page
    assert page.count("<script>") == 1  # only the page's own copy-button script
    md = report_html.render_markdown(evil)
    assert EVIL not in md and "<i>" not in md and "&lt;script&gt;" in md
    row = next(line for line in md.splitlines() if "alert" in line and line.startswith("| "))
    assert "\\| cell break |" in row and row.count(" | ") == 10  # the pipe cannot split the cell
    assert "x = '</pre>'" in md  # code blocks are verbatim


def test_round_trip_through_json_renders_the_same_page(result, written, tmp_path):
    path = write_json(tmp_path / "tune.json", "tune", result.env, result.to_dict())
    again = TuneResult.from_dict(json.loads(path.read_text(encoding="utf-8")))
    charts = _charts(written)
    assert report_html.render_html(again, charts=charts) == report_html.render_html(result, charts=charts)
    assert report_html.render_markdown(again, charts=charts) == report_html.render_markdown(
        result, charts=charts
    )


def test_charts_given_are_copied_and_embedded(written, result, tmp_path):
    src = tmp_path / "elsewhere"
    src.mkdir()
    png = src / "mine.png"
    png.write_bytes(written["bench"].read_bytes())
    out = report_html.write_report(result, tmp_path / "out", charts={"bench": png, "missing": src / "no.png"})
    assert out["bench"] == tmp_path / "out" / "bench.png" and out["bench"].is_file()
    assert "missing" not in out and not (tmp_path / "out" / "check.png").exists()
    assert out["html"].read_text(encoding="utf-8").count("<img ") == 1
    # charts already in out_dir under their own name are left alone
    again = report_html.write_report(result, tmp_path / "out", charts={"bench": out["bench"]})
    assert again["bench"].read_bytes() == png.read_bytes()


def test_empty_states(result):
    bare = dataclasses.replace(
        result, recommendation=None, lint=None, exports={}, export_refusals={}, env={}, check=None
    )
    page, md = report_html.render_html(bare), report_html.render_markdown(bare)
    assert _h2(page) == HEADINGS and _md_h2(md) == HEADINGS
    empty = ("No candidate is recommended.", "Lint was not run.", "No exports: nothing was recommended.")
    for text in (*empty, "No charts: "):
        assert text in page and text in md
    assert 'class="verdict bad"' in page
    assert "No findings." in report_html.render_html(dataclasses.replace(result, lint=[]))


def test_lint_findings_table(result):
    page = report_html.render_html(dataclasses.replace(result, lint=_findings()))
    section = page[page.index('<section id="lint-findings">') : page.index('<section id="exports">')]
    assert section.count("<tr>") == 3  # header + two findings
    assert (
        '<span class="sev warn">warning</span>' in section
        and '<span class="sev muted">info</span>' in section
    )
    assert "<b>+4.2% step</b><br>step 5.00 → 4.79 ms<br>layer 1.20 → 0.90 ms" in section
    assert '<td class="mono">(model)</td>' in section  # a model-wide finding
    md = report_html.render_markdown(dataclasses.replace(result, lint=_findings()))
    assert "| MP101 | warning | net.0 | in_features=100 is not a multiple of 8 | pad to 104 " in md
    assert "+4.2% step; step 5.00 → 4.79 ms; layer 1.20 → 0.90 ms |" in md


# ---------------------------------------------------------------------------------------------
# A schema-1 file (mixprec 0.1)


def test_old_schema_1_file_renders(old_result):
    page = report_html.render_html(old_result)
    assert _h2(page) == HEADINGS
    assert "Use bf16-mixed+cl: 2.06x the throughput of strict fp32" in page
    marked = re.findall(r'<tr class="recommended">(.*?)</tr>', page)
    assert len(marked) == 1 and "bf16-mixed+<wbr>cl" in marked[0]
    assert "<code>MP201</code> <b>(model)</b>" in page  # lint worth fixing
    assert page.count('<pre id="export-') == 7
    assert "measured with batch 16, steps 4, warmup 1, threads 2." in page
    assert "strict fp32 was 2% faster at the end of the sweep than at its start" in page
    assert _md_h2(report_html.render_markdown(old_result)) == HEADINGS


@pytest.mark.slow
def test_report_command_renders_the_old_file(tmp_path, capsys):
    assert main(["report", str(OLD_FILE), "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.png", "check.png", "index.html", "report.md"]
    assert "wrote" in capsys.readouterr().err
    assert (tmp_path / "index.html").read_text(encoding="utf-8").count("data:image/png;base64,") == 2


# ---------------------------------------------------------------------------------------------
# Formatting


def test_formatting():
    assert fmt.fmt_speedup(2.456) == "2.46x"
    assert fmt.fmt_throughput(1481.36) == "1,481.4"
    assert fmt.fmt_bytes(3 * 2**20) == "3.0 MiB"
    assert fmt.fmt_bytes(5 * 2**30) == "5.00 GiB"
    assert fmt.fmt_bytes(-2 * 2**20) == "-2.0 MiB"
    assert fmt.fmt_ms(12.34, 0.56) == "12.3 ± 0.6"
    assert fmt.fmt_ms(12.34) == "12.3"
    assert fmt.fmt_pct(0.123) == "12.3%" and fmt.fmt_pct(-0.022, sign=True) == "-2.2%"
    assert fmt.fmt_pct(0.05, sign=True) == "+5.0%" and fmt.fmt_pct("inf") == "inf"
    assert fmt.fmt_small_pct(2.07e-5) == "0.0021%"
    assert fmt.fmt_db(14.71) == "14.7 dB" and fmt.fmt_db("-inf") == "-inf dB"
    assert fmt.fmt_seconds(17.4) == "17 s" and fmt.fmt_seconds(None) == ""
    assert fmt.fmt_date("2026-11-22T11:30:00Z") == "2026-11-22 11:30 UTC"
    for f in (fmt.fmt_speedup, fmt.fmt_bytes, fmt.fmt_throughput, fmt.fmt_seconds):
        assert f(None) == "" and f("junk") == "" and f(True) == ""


def test_fmt_gain_reads_measured_gain():
    step = MeasuredGain(layer_before_ms=1.2, layer_after_ms=0.9, step_before_ms=5.0, step_after_ms=4.79)
    assert fmt.fmt_gain(step.to_dict()) == "+4.2% step; step 5.00 → 4.79 ms; layer 1.20 → 0.90 ms"
    layer = MeasuredGain(layer_before_ms=2.0, layer_after_ms=1.0)
    assert fmt.fmt_gain(layer.to_dict()) == "+50.0% layer; layer 2.00 → 1.00 ms"
    assert fmt.fmt_gain(None) == "" and fmt.fmt_gain(MeasuredGain().to_dict()) == ""


def test_markdown_filters():
    assert report_html.md("a | b\nc  d") == "a \\| b c d"
    assert report_html.md("<b>x</b> & *y* [z]") == "&lt;b&gt;x&lt;/b&gt; &amp; \\*y\\* \\[z\\]"
    assert report_html.md("max_rel_loss _x_") == "max_rel_loss \\_x\\_"
    assert report_html.code("a`b") == "``a`b``" and report_html.code("`") == "`` ` ``"
    assert report_html.fence("x = '```'\n", "python") == "````python\nx = '```'\n````"
