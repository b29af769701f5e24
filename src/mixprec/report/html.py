"""The `tune` report: one self-contained HTML page and a Markdown twin, from a :class:`TuneResult`.

Both are rendered by jinja2 from the same view (:func:`mixprec.report.view.build`), with the
templates in ``report/templates``. ``write_report(result, out_dir)`` writes ``out_dir/index.html``
(the CSS and the copy-button script of ``report/static`` inlined, every chart embedded as a
base64 ``data:`` URI, so the single file can be mailed) and ``out_dir/report.md`` (the charts as
PNG files next to it). Everything that comes from the result is escaped: by autoescaping in
HTML, by the ``md`` filter in Markdown.
"""

from __future__ import annotations

import base64
import html
import os
import re
from collections.abc import Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2
from markupsafe import Markup, escape

from mixprec.errors import UsageError
from mixprec.files import atomic_write_bytes, atomic_write_text
from mixprec.report import view as report_view
from mixprec.report.view_types import ReportView

if TYPE_CHECKING:
    from mixprec.tuning import TuneResult

Charts = Mapping[str, str | Path]

_PACKAGE = "mixprec.report"


# ---------------------------------------------------------------------------------------------
# Filters


def md(text: object) -> str:
    """Text for a Markdown line or table cell: no raw HTML, no Markdown markup, one line, no ``|``."""
    out = html.escape("" if text is None else str(text), quote=False)
    out = re.sub(r"([\\`*\[\]|])", r"\\\1", out)
    out = re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", out)  # intraword _ is literal
    return " ".join(out.split())


def code(text: object) -> str:
    """``text`` as one Markdown code span, however many backticks it holds."""
    body = " ".join(str(text).split())
    ticks = "`"
    while ticks in body:
        ticks += "`"
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{ticks}{pad}{body}{pad}{ticks}"


def fence(text: str, lang: str = "") -> str:
    """``text`` as a fenced Markdown code block, the fence longer than any backtick run in it."""
    ticks = "```"
    while ticks in text:
        ticks += "`"
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def br(text: str) -> Markup:
    """Escaped ``text`` with its line breaks as ``<br>`` (HTML column headers)."""
    return Markup("<br>").join(escape(part) for part in text.split("\n"))


@cache
def _environment(kind: str) -> jinja2.Environment:
    """The jinja2 environment of the HTML (autoescaped) or the Markdown templates."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader(_PACKAGE, "templates"),
        autoescape=kind == "html",
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(md=md, code=code, fence=fence, br=br)
    return env


def _static(name: str) -> str:
    return resources.files(_PACKAGE).joinpath("static", name).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Rendering


def data_uri(path: str | Path) -> str | None:
    """A PNG file as a base64 ``data:`` URI; None when it cannot be read."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    return "data:image/png;base64," + base64.b64encode(raw).decode("ascii")


def render_view(view: ReportView, kind: str) -> str:
    """``view`` laid out by ``report.html.j2`` (kind 'html') or ``report.md.j2`` (kind 'md')."""
    template = _environment(kind).get_template(f"report.{kind}.j2")
    if kind == "html":  # package data, trusted: inlined as is
        return template.render(view=view, css=Markup(_static("report.css")), js=Markup(_static("report.js")))
    return template.render(view=view)


def render_html(result: TuneResult, *, charts: Charts | None = None) -> str:
    """The whole report as one self-contained HTML page; ``charts`` (name -> PNG) are embedded
    (a chart whose file cannot be read is left out)."""
    uris = {str(name): data_uri(path) for name, path in (charts or {}).items()}
    return render_view(report_view.build(result, {k: v for k, v in uris.items() if v}), "html")


def render_markdown(result: TuneResult, *, charts: Charts | None = None) -> str:
    """The report as Markdown; ``charts`` maps a chart name to the image to reference (a path
    relative to the Markdown file)."""
    refs = {str(name): Path(ref).as_posix() for name, ref in (charts or {}).items()}
    return render_view(report_view.build(result, refs), "md")


# ---------------------------------------------------------------------------------------------
# Files


def draw_charts(result: TuneResult, out_dir: str | Path) -> dict[str, Path]:
    """Draw the bench chart (throughput, memory) and the check chart (losses, headroom) into
    ``out_dir`` as ``bench.png`` and ``check.png``; one without data to draw is left out."""
    from mixprec.report import bench as bench_report
    from mixprec.report import check as check_report

    out = Path(out_dir)
    charts: dict[str, Path] = {}
    if result.bench.rows:
        charts["bench"] = bench_report.plot(out / "bench.png", result.bench)
    if result.check is not None and result.check.candidates:
        charts["check"] = check_report.plot(out / "check.png", result.check)
    return charts


def _place_charts(charts: Charts, out: Path) -> dict[str, Path]:
    """Copy existing chart files into ``out`` as ``<name>.png``; missing ones are left out."""
    placed = {}
    for name, src in charts.items():
        src = Path(src)
        if not src.is_file():
            continue
        dest = out / f"{report_view.slug(str(name))}.png"
        if not (dest.exists() and dest.resolve() == src.resolve()):
            atomic_write_bytes(dest, src.read_bytes(), "report chart")
        placed[str(name)] = dest
    return placed


# The files write_report puts in its folder (charts only when there is data to draw).
REPORT_FILES = ("index.html", "report.md", "bench.png", "check.png")


def report_folder(out_dir: str | os.PathLike[str], option: str = "report folder") -> Path:
    """``out_dir`` created if missing; a UsageError when it is a file or cannot be created."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(
            f"{option} {str(out)!r} is a file, not a folder; pass a folder for index.html and report.md."
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option} {str(out)!r}: cannot create it ({exc.strerror or exc}).") from None
    return out


def write_report(result: TuneResult, out_dir: str | Path, charts: Charts | None = None) -> dict[str, Path]:
    """Write ``out_dir/index.html`` and ``out_dir/report.md`` for ``result`` and return their paths.

    ``charts`` maps a chart name (``"bench"``, ``"check"``) to an existing PNG, copied into
    ``out_dir`` as ``<name>.png`` (the Markdown references it; the HTML embeds it). Without it the
    charts are drawn from the result. The returned dict maps ``"html"`` and ``"markdown"`` to the
    two reports and each chart name to its PNG in ``out_dir``.
    """
    out = report_folder(out_dir)
    placed = draw_charts(result, out) if charts is None else _place_charts(charts, out)
    html_path, md_path = out / "index.html", out / "report.md"
    atomic_write_text(html_path, render_html(result, charts=placed), "report file")
    atomic_write_text(
        md_path, render_markdown(result, charts={k: p.name for k, p in placed.items()}), "report file"
    )
    return {"html": html_path, "markdown": md_path, **placed}
