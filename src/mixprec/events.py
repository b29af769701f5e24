"""The one event stream of ``bench``, ``check`` and ``tune``: what a command is doing, as it happens.

Every command takes ``events: Callable[[Event], None]`` and reports through it; the CLI's progress
lines, tune's own bookkeeping and user code all read the same stream. An event is a dict with an
``"event"`` key naming its kind:

- ``stage``: ``{"text"}``, what the command does now ("checking the workload: one strict-fp32 step");
- ``candidate``: ``{"label", "index", "count"}``, a sweep starts measuring a candidate;
- ``step``: ``{"label", "index", "seconds", "timed", "loss", "total"}``, one training step of it;
- ``row``: ``{"row", "index", "count", "resumed"}``, a candidate's finished :class:`mixprec.BenchRow`;
- ``verdict``: ``{"check", "index", "count"}``, a candidate's :class:`mixprec.CandidateCheck`;
- ``note``: ``{"text"}``, something the user should know (a resumed stream's rows, a skipped stage);
- ``output``: ``{"label", "text"}``, what rebuilding the workload printed in a candidate's process.

Dicts rather than classes so events cross process boundaries and JSON as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Event = dict[str, Any]
Events = Callable[[Event], None]
KINDS = ("stage", "candidate", "step", "row", "verdict", "note", "output")


def ignore(event: Event) -> None:
    """The stream nobody listens to."""


def stage(text: str) -> Event:
    return {"event": "stage", "text": text}


def note(text: str) -> Event:
    return {"event": "note", "text": text}


def candidate(label: str, index: int, count: int) -> Event:
    return {"event": "candidate", "label": label, "index": index, "count": count}
