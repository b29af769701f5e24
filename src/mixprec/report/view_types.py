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
    emphasised), or bar (``fraction`` in [0, 1] drawn as a bar next to the text); ``text`` is always
    the whole content on one line."""

    text: str
    kind: str = "text"
    tone: str = ""
    lines: tuple[str, ...] = ()
    fraction: float | None = None


@dataclass(frozen=True)
class Column:
    """A table column; ``label`` may hold a line break, ``numeric`` columns align right."""

    label: str
    numeric: bool = False


@dataclass(frozen=True)
class Row:
    """A table row; a ``marked`` row is the recommended one."""

    cells: tuple[Cell, ...]
    marked: bool = False


@dataclass(frozen=True)
class Table:
    """Columns and rows, laid out the same way by both templates."""

    columns: tuple[Column, ...]
    rows: tuple[Row, ...]


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
class ReportView:
    """The whole report: header, verdict banner, the sections in order, footer."""

    title: str
    workload: str
    description: str
    meta: tuple[Pair, ...]
    verdict_tone: str
    verdict: str
    sections: tuple[Section, ...]
    command: str
    footer: str


# ---------------------------------------------------------------------------------------------
# Fixed wording: chart and export titles, table columns

CHART_TITLES = {
    "bench": "Throughput and peak memory",
    "check": "Loss curves against fp32 and per-layer fp16 headroom",
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
    Column("candidate"),
    Column("status"),
    Column("samples/s", True),
    Column("speedup\nvs fp32", True),
    Column("step ms\nmedian ± IQR", True),
    Column("peak\nmemory", True),
    Column("MFU", True),
    Column("compile", True),
    Column("matmul/conv\nshare of step"),
    Column("numerics"),
    Column("why"),
)

LINT_COLUMNS = (
    Column("rule"),
    Column("severity"),
    Column("module"),
    Column("message"),
    Column("fix"),
    Column("measured gain", True),
)
