"""The data types of the tune report's view model (built by :mod:`mixprec.report.view`), and its
fixed wording (chart and export titles, table columns).

Plain frozen dataclasses of strings and tuples: the templates read their attributes and nothing
else. No text in them is escaped; the templates escape on output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Pair:
    """A labelled value: a meta item, a fact in a key/value table."""

    key: str
    value: str


@dataclass(frozen=True)
class Cell:
    """One table cell. ``kind`` says how to lay it out: text, mono, num, badge (with ``tone``),
    severity (with ``tone``), why (a muted explanation), candidate, gain (``lines``, the first
    emphasised), or bar (``fraction`` in [0, 1] drawn as a bar next to the text).

    ``text`` is the content on one line; ``full`` is the whole text when ``text`` is shortened
    for the HTML table (shown on demand there, and in Markdown instead of ``text``). ``parts`` are
    the pieces of ``text`` where it may wrap (a candidate label cut after each '+'), empty when it
    wraps only at spaces."""

    text: str
    kind: str = "text"
    tone: str = ""
    lines: tuple[str, ...] = ()
    fraction: float | None = None
    full: str = ""
    parts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Column:
    """A table column; ``label`` may hold a line break, ``numeric`` columns align right; ``key``
    names the column for the stylesheet (its width), empty where the browser sizes it."""

    label: str
    numeric: bool = False
    key: str = ""


@dataclass(frozen=True)
class Row:
    """A table row; a ``marked`` row is the recommended one."""

    cells: tuple[Cell, ...]
    marked: bool = False


@dataclass(frozen=True)
class Table:
    """Columns and rows, laid out the same way by both templates; ``name`` is the HTML table's
    class (the candidates table has fixed column widths so it fits the page)."""

    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    name: str = ""


@dataclass(frozen=True)
class Card:
    """A headline number of the recommendation, with the limit it was held to (or what it means)."""

    name: str
    value: str
    note: str = ""


@dataclass(frozen=True)
class FindingItem:
    """A lint finding in a list: rule, where, what, the fix and the measured gain."""

    rule: str
    where: str
    message: str
    fix: str
    gain: str


@dataclass(frozen=True)
class RecommendationView:
    """The pick: its label, the number cards, keep_fp32, why it won, and lint worth fixing."""

    label: str
    detail: str
    cards: tuple[Card, ...]
    keep_fp32: tuple[str, ...]
    reason: str
    tie_break: str
    worth_fixing: tuple[FindingItem, ...]


@dataclass(frozen=True)
class CandidatesView:
    """The decision table and the notes on how it was measured."""

    table: Table
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Chart:
    """A chart: ``src`` is what the page points at (a data: URI in HTML, a file name in Markdown)."""

    name: str
    title: str
    src: str


@dataclass(frozen=True)
class Export:
    """The recommended policy written for one training stack; ``anchor`` names its code block.
    ``refused`` says why the stack cannot run the policy faithfully (then there is no text)."""

    key: str
    title: str
    lang: str
    anchor: str
    text: str
    refused: str = ""


@dataclass(frozen=True)
class KeyValues:
    """A titled key/value table (the environment section has two), with a note under it."""

    title: str
    pairs: tuple[Pair, ...]
    note: str = ""


@dataclass(frozen=True)
class Section:
    """One ``##`` section: ``lead`` is shown above the content; ``empty`` instead of it when the
    result holds nothing for this section (``body`` is None then)."""

    id: str
    title: str
    body: Any = None
    lead: str = ""
    empty: str = ""


@dataclass(frozen=True)
class Segment:
    """One part of the budget bar: a tune phase, or the budget left over (``unused``).

    ``key`` is its CSS class (its colour), ``seconds`` and ``share`` (of the budget) are the
    legend's figures, ``width`` is its length in percent of the bar, and ``title`` says all of it
    in words (the segment's tooltip)."""

    name: str
    key: str
    seconds: str
    share: str
    width: float
    title: str
    unused: bool = False


@dataclass(frozen=True)
class BudgetView:
    """Where tune's time went: the phases in order, then the unused budget, drawn as one stacked
    bar with a legend. ``caption`` heads it; ``label`` is the whole bar in words (its text
    alternative)."""

    caption: str
    label: str
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class ReportView:
    """The whole report: header (with the budget bar, None for results that did not record their
    phases), verdict banner, the sections in order, footer."""

    title: str
    workload: str
    description: str
    meta: tuple[Pair, ...]
    verdict_tone: str
    verdict: str
    sections: tuple[Section, ...]
    command: str
    footer: str
    budget: BudgetView | None = None


# ---------------------------------------------------------------------------------------------
# Fixed wording: chart and export titles, table columns

CHART_TITLES = {
    "bench": "Throughput and peak memory",
    "check": (
        "Loss curves against fp32, per-layer fp16 headroom, and headroom over the checked steps "
        "with the trend that predicts an overflow"
    ),
}
EXPORT_TITLES = {
    "mixprec": "mixprec",
    "pytorch": "PyTorch (autocast)",
    "lightning": "Lightning",
    "accelerate": "Accelerate",
    "deepspeed": "DeepSpeed",
    "fsdp2": "FSDP2",
    "hf": "Hugging Face Trainer",
}
# Fenced-code language per export; the accelerate and deepspeed exports mix a config file with Python.
EXPORT_LANGS = {"accelerate": "", "deepspeed": ""}
SEVERITY_TONES = {"error": "bad", "warning": "warn", "info": "muted"}

CANDIDATE_COLUMNS = (
    Column("candidate", key="candidate"),
    Column("status", key="status"),
    Column("samples/s", True, "throughput"),
    Column("speedup\nvs fp32", True, "speedup"),
    Column("step ms\nmedian ± IQR", True, "step"),
    Column("peak\nmemory", True, "memory"),
    Column("MFU", True, "mfu"),
    Column("compile", True, "compile"),
    Column("matmul/conv\nshare of step", key="share"),
    Column("numerics", key="numerics"),
    Column("why", key="why"),
)
# The candidates table's "why" cell shows this many characters at most (cut at a word, the
# whole reason on demand): two lines of its column on a 1400 px wide page.
WHY_CHARS = 80

LINT_COLUMNS = (
    Column("rule"),
    Column("severity"),
    Column("module"),
    Column("message"),
    Column("fix"),
    Column("measured gain", True),
)
