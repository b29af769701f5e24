"""The tune report: HTML and Markdown from the tune JSON dict (sample in tests/data/tune_sample.json)."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest

from mixprec.measure.results import BenchResult
from mixprec.numerics.results import CheckResult
from mixprec.report import format as fmt
from mixprec.report import html as report_html

SAMPLE = Path(__file__).parent / "data" / "tune_sample.json"
HEADINGS = ["Recommendation", "Candidates", "Charts", "Lint findings", "Exports", "Environment"]


@pytest.fixture(scope="module")
def sample() -> dict:
    return json.loads(SAMPLE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def written(sample, tmp_path_factory) -> dict[str, Path]:
    """One full report with the charts drawn from the data (matplotlib: the slow part)."""
    return report_html.write_report(sample, tmp_path_factory.mktemp("report"))


def _h2(text: str) -> list[str]:
    return re.findall(r"<h2>(.*?)</h2>", text)


def test_sample_is_small_and_a_tune_file(sample):
    assert SAMPLE.stat().st_size < 200_000
    assert sample["kind"] == "tune"
    assert sample["bench"]["rows"] and sample["check"]["candidates"]


def test_write_report_files_and_sections_in_order(written):
    assert written["html"].name == "index.html" and written["markdown"].name == "report.md"
    page = written["html"].read_text(encoding="utf-8")
    assert _h2(page) == HEADINGS
    assert "<header>" in page and "<footer>" in page
    assert "mixprec tune --model mlp" in page  # command line in the footer
    assert "schema version 1" in page
    md = written["markdown"].read_text(encoding="utf-8")
    positions = [md.index(f"\n## {h}\n") for h in HEADINGS]
    assert positions == sorted(positions)


def test_html_is_self_contained(written):
    page = written["html"].read_text(encoding="utf-8")
    imgs = re.findall(r"<img\b[^>]*>", page)
    assert len(imgs) == 2  # bench and check charts
    for tag in imgs:
        assert re.search(r'src="data:image/png;base64,[A-Za-z0-9+/=]+"', tag), tag[:80]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "<link" not in page and "@import" not in page and "url(" not in page


def test_markdown_charts_exist_next_to_it(written):
    md = written["markdown"].read_text(encoding="utf-8")
    refs = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert sorted(refs) == ["bench.png", "check.png"]
    out_dir = written["markdown"].parent
    for ref in refs:
        assert (out_dir / ref).is_file()
        assert (out_dir / ref).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_candidates_table(sample):
    md = report_html.render_markdown(sample)
    lines = md.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| candidate | status | samples/s"))
    assert lines[head + 1].startswith("|---|---|---:|")
    rows = [line for line in lines[head + 2 :] if line.startswith("| ")]
    rows = rows[: len(sample["candidates"])]
    assert len(rows) == len(sample["candidates"])
    assert rows[0].startswith("| **bf16-mixed** ★ | recommended |")
    assert any("| pruned |" in r for r in rows)


def test_recommended_row_marked_and_numbers_formatted(sample):
    page = report_html.render_html(sample)
    rec = re.search(r'<tr class="recommended">(.*?)</tr>', page)
    assert rec and "bf16-mixed" in rec.group(1)
    assert page.count('<tr class="recommended">') == 1
    speedup = sample["recommendation"]["speedup_vs_fp32"]
    assert f"{speedup:.2f}x" in page
    assert f"{sample['candidates'][0]['throughput']:,.1f}" in page
    assert " MiB" in page
    for cls in ("badge good", "badge bad", "badge warn", "badge muted"):
        assert cls in page
    for target in ("mixprec", "pytorch", "lightning", "accelerate", "deepspeed", "fsdp2", "hf"):
        assert f'<pre id="export-{target}">' in page


def test_charts_given_are_copied_and_embedded(written, tmp_path, sample):
    src = tmp_path / "elsewhere"
    src.mkdir()
    png = src / "mine.png"
    png.write_bytes(written["bench"].read_bytes())
    out = report_html.write_report(sample, tmp_path / "out", charts={"bench": png, "missing": src / "no.png"})
    assert out["bench"] == tmp_path / "out" / "bench.png" and out["bench"].is_file()
    assert "missing" not in out
    assert out["html"].read_text(encoding="utf-8").count("<img ") == 1
    # charts already in out_dir under their own name are left alone
    again = report_html.write_report(sample, tmp_path / "out", charts={"bench": out["bench"]})
    assert again["bench"].read_bytes() == png.read_bytes()


def test_data_is_escaped(sample, tmp_path):
    data = copy.deepcopy(sample)
    evil = '<script>alert("x")</script>'
    data["candidates"][1]["reason"] = evil
    data["lint"]["findings"][0]["module"] = "blocks.<b>0</b>&fc"
    data["recommendation"]["reason"] = "a < b && c > d"
    data["exports"]["pytorch"] = "if a < b:\n    x = '</pre>'\n"
    data["workload"] = "<i>net</i>"
    page = report_html.write_report(data, tmp_path, charts={})["html"].read_text(encoding="utf-8")
    assert evil not in page and "<b>0</b>" not in page and "<i>net</i>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "blocks.&lt;b&gt;0&lt;/b&gt;&amp;fc" in page
    assert "a &lt; b &amp;&amp; c &gt; d" in page
    assert "x = &#x27;&lt;/pre&gt;&#x27;" in page
    assert page.count("<script>") == 1  # only the page's own copy-button script
    md = report_html.render_markdown(data)
    assert evil not in md and "&lt;script&gt;" in md


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"kind": "tune"},
        {
            "schema_version": 1,
            "kind": "tune",
            **dict.fromkeys(
                (
                    "command",
                    "env",
                    "workload",
                    "description",
                    "device",
                    "created",
                    "budget_s",
                    "elapsed_s",
                    "bench",
                    "check",
                    "lint",
                    "candidates",
                    "recommendation",
                    "exports",
                )
            ),
        },
        {
            "kind": "tune",
            "env": {"device": "cuda", "precision_state": None},
            "bench": {"rows": [{"policy": "fp32", "status": "ok", "step_time_ms": {"median": 3}}]},
            "check": {"candidates": [{"policy": "bf16-mixed", "losses": ["nan", 1.0]}]},
            "lint": {"findings": []},
            "candidates": [{"label": None, "status": None, "step_time_ms": "7", "mfu": "inf"}, "junk"],
            "recommendation": {"label": "bf16-mixed", "margin": None, "keep_fp32": None},
            "exports": {"hf": None, "custom": "x = 1"},
            "created": "not a date",
        },
    ],
    ids=["empty", "kind-only", "all-null", "odd-values"],
)
def test_partial_data_renders(data, tmp_path):
    out = report_html.write_report(data, tmp_path)
    page = out["html"].read_text(encoding="utf-8")
    assert _h2(page) == HEADINGS
    md = out["markdown"].read_text(encoding="utf-8")
    for heading in HEADINGS:
        assert f"## {heading}" in md
    if data.get("lint") == {"findings": []}:
        assert "No findings." in page and "No findings." in md


def test_result_objects_from_dicts(sample):
    bench = BenchResult.from_dict(sample["bench"])
    assert len(bench.rows) == len(sample["bench"]["rows"])
    assert bench.baseline is not None and bench.baseline.step_time_ms.n == 8
    raw = copy.deepcopy(sample["check"])
    raw["candidates"][0]["losses"][1] = "inf"
    raw["candidates"][0]["unknown_future_key"] = 1
    check = CheckResult.from_dict(raw)
    assert [c.label for c in check.candidates] == ["bf16-mixed", "fp16-mixed"]
    assert math.isinf(check.candidates[0].losses[1])
    assert check.reference_layers[0]["forward_headroom_bits"]["fp16"] > 0


def test_formatting():
    assert fmt.fmt_speedup(2.456) == "2.46x"
    assert fmt.fmt_throughput(1481.36) == "1,481.4"
    assert fmt.fmt_bytes(3 * 2**20) == "3.0 MiB"
    assert fmt.fmt_bytes(5 * 2**30) == "5.00 GiB"
    assert fmt.fmt_bytes(-2 * 2**20) == "-2.0 MiB"
    assert fmt.fmt_ms(12.34, 0.56) == "12.3 ± 0.6"
    assert fmt.fmt_small_pct(2.07e-5) == "0.0021%"
    assert fmt.fmt_date("2026-11-22T11:30:00Z") == "2026-11-22 11:30 UTC"
    for f in (fmt.fmt_speedup, fmt.fmt_bytes, fmt.fmt_throughput):
        assert f(None) == "" and f("junk") == "" and f(True) == ""
