"""Where a sweep's finished rows go: into the result (derived figures recomputed), onto the row
stream when there is one (:class:`~mixprec.measure.rowstore.RowStore`), and to the event stream."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from mixprec.events import Events
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.measure.rowstore import RowStore
from mixprec.status import Status


class RowRecorder:
    """A sweep's rows, as they finish. ``done`` holds the finished rows a resumed stream already had;
    errors and OOMs may be transient, so those rows are measured again."""

    KEPT = (Status.OK, Status.UNSUPPORTED, Status.PRUNED, Status.NO_EFFECT)

    def __init__(
        self,
        result: BenchResult,
        events: Events,
        count: int,
        jsonl: str | Path | None,
        key: dict[str, Any],
        *,
        resume: bool,
        resume_anyway: bool = False,
    ) -> None:
        self.result, self.events, self.count = result, events, count
        self.store: RowStore | None = None
        self.done: dict[tuple, BenchRow] = {}
        self.resumed: set[tuple] = set()  # keys of the rows taken from the stream, not measured now
        if jsonl is not None:
            self.store = RowStore(jsonl, key, resume=resume, resume_anyway=resume_anyway)
            for note in self.store.notes:
                result.notes.append(note)
                events({"event": "note", "text": note})
            # the closing strict-fp32 row (baseline_repeat in the stream) is the baseline's last word
            kept = [replace(r, baseline_repeat=False) for r in self.store.rows if r.status in self.KEPT]
            self.done = {r.key: r for r in kept}

    def record(self, row: BenchRow, index: int, resumed: bool = False, *, closing: bool = False) -> None:
        """``closing``: strict fp32's row again at the end of the sweep, over every step it timed; it
        replaces its first row in the result, and is marked ``baseline_repeat`` in the stream, where
        the first stays (a reader sees which of the two fp32 rows is the repeat)."""
        self.result.update(row)
        if resumed:
            self.resumed.add(row.key)
        shown = next(r for r in self.result.rows if r.key == row.key)
        if self.store is not None and not resumed:
            self.store.append(replace(shown, baseline_repeat=True) if closing else shown)
        self.events({"event": "row", "row": shown, "index": index, "count": self.count, "resumed": resumed})

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
