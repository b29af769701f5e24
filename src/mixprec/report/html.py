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
from mixprec.files import atomic_write_bytes
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


def png_uri(raw: bytes) -> str:
    """PNG bytes as a base64 ``data:`` URI."""
    return "data:image/png;base64," + base64.b64encode(raw).decode("ascii")


def data_uri(path: str | Path) -> str | None:
    """A PNG file as a base64 ``data:`` URI; None when it cannot be read."""
    try:
        return png_uri(Path(path).read_bytes())
    except OSError:
        return None


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


def chart_images(result: TuneResult) -> dict[str, bytes]:
    """The bench chart (throughput, memory) and the check chart (losses, headroom) as PNG bytes;
    one without data to draw is left out."""
    from mixprec.report import bench as bench_report
    from mixprec.report import check as check_report

    images: dict[str, bytes] = {}
    if result.bench.rows:
        images["bench"] = bench_report.png(result.bench)
    if result.check is not None and result.check.candidates:
        images["check"] = check_report.png(result.check)
    return images


def render_report(result: TuneResult, charts: Charts | None = None) -> dict[str, tuple[str, bytes]]:
    """Every file of the report, in memory: role ('html', 'markdown', a chart name) -> (file name,
    bytes). ``charts`` (name -> existing PNG) replaces drawing them; a missing one is left out."""
    if charts is None:
        images = chart_images(result)
    else:
        images = {str(n): Path(src).read_bytes() for n, src in charts.items() if Path(src).is_file()}
    names = {name: f"{report_view.slug(name)}.png" for name in images}
    uris = {
        name: "data:image/png;base64," + base64.b64encode(raw).decode("ascii") for name, raw in images.items()
    }
    html_text = render_view(report_view.build(result, uris), "html")
    md_text = render_markdown(result, charts=names)
    return {
        "html": ("index.html", html_text.encode("utf-8")),
        "markdown": ("report.md", md_text.encode("utf-8")),
        **{name: (names[name], raw) for name, raw in images.items()},
    }


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
    return write_files(render_report(result, charts), out_dir)


def write_files(files: Mapping[str, tuple[str, bytes]], out_dir: str | Path) -> dict[str, Path]:
    """Write what :func:`render_report` rendered into ``out_dir``; role -> path written."""
    out = report_folder(out_dir)
    return {role: atomic_write_bytes(out / name, raw, "report file") for role, (name, raw) in files.items()}
