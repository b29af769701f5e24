"""Progress of the commands that measure candidates one by one (bench, check, tune).

On a terminal: a live rich bar on stderr, with one line per finished candidate printed above it.
Anywhere else (CI logs, ``nohup``, a notebook's captured cell, ``| tee``), where a live display
is dropped: one plain line per finished candidate, flushed at once, with the elapsed time and an
estimate of the time left, so a logged run is never silent for minutes.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from mixprec.report.progress import bench_row_line, progress_line, verdict_line


def sweep_progress(console: Console) -> Progress:
    """The progress bar (on stderr) of the commands that measure candidates one by one."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


class CandidateProgress:
    """Shows stage text, finished candidates and (with ``verbose``) what child processes printed.

    ``budget_s``: the command ends within this many seconds (tune): the time left is the
    budget's, not an estimate from the candidates finished so far.
    """

    def __init__(
        self, err: Console, title: str, *, verbose: bool = False, budget_s: float | None = None
    ) -> None:
        self.err, self.title, self.verbose, self.budget_s = err, title, verbose, budget_s
        self.live = err.is_terminal
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._start = time.perf_counter()
        self._finished: set[Any] = set()

    def __enter__(self) -> CandidateProgress:
        self._start = time.perf_counter()
        if self.live:
            self._bar = sweep_progress(self.err)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=None)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, exc, tb)
            self._bar = None

    # ---------------------------------------------------------------- what callers report
    def status(self, text: str, *, completed: int | None = None, total: int | None = None) -> None:
        """The current stage (live display only; a log gets the finished candidates)."""
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=text, completed=completed, total=total)
        elif self.verbose:
            self._line(text)

    def finished(
        self, label: str, status: str, figure: str, *, index: int | None = None, count: int | None = None
    ) -> None:
        """One candidate is done: its line, with the time so far and the time left."""
        key = (label, index)
        repeat = key in self._finished
        self._finished.add(key)
        elapsed = time.perf_counter() - self._start
        eta: float | None = None
        if self.budget_s is not None:
            eta = max(0.0, self.budget_s - elapsed)
        elif count:
            done = len({i for _, i in self._finished if i is not None})
            eta = elapsed / done * max(0, count - done) if done else None
        line = progress_line(
            label + (" (again)" if repeat else ""),
            status,
            figure,
            elapsed_s=elapsed,
            eta_s=eta,
            eta_is_budget=self.budget_s is not None,
            position=(index + 1, count) if index is not None and count and self.budget_s is None else None,
        )
        if self._bar is not None and self._task is not None and count:
            done = len({i for _, i in self._finished if i is not None})
            self._bar.update(self._task, completed=done, total=count)
        self._line(line)

    def output(self, label: str, text: str) -> None:
        """What rebuilding the workload printed in a candidate's process: shown with --verbose
        (this process showed the same output once, when it built the workload)."""
        if self.verbose and text.strip():
            self._line(f"{label}: the workload printed while being rebuilt in its process:")
            for line in text.rstrip().splitlines():
                self._line(f"  | {line}")

    # ---------------------------------------------------------------- the event stream
    def event(self, event: dict[str, Any]) -> None:
        """One event of bench's, check's or tune's stream (:mod:`mixprec.events`)."""
        kind = event["event"]
        if kind == "stage":
            self.status(event["text"])
        elif kind == "candidate":
            self.status(
                f"{event['label']}: starting",
                completed=None if self.budget_s is not None else event["index"],
                total=None if self.budget_s is not None else event["count"],
            )
        elif kind == "step":
            phase = "timed" if event["timed"] else "warm-up"
            self.status(f"{event['label']}: {phase} step {event['index'] + 1}/{event['total']}")
        elif kind == "row":
            label, status, figure = bench_row_line(event["row"])
            if event.get("resumed"):
                status += " (resumed)"
            tuning = self.budget_s is not None
            self.finished(
                label,
                status,
                figure,
                index=None if tuning else event["index"],
                count=None if tuning else event["count"],
            )
        elif kind == "output":
            self.output(event["label"], event["text"])
        elif kind == "note":  # e.g. a resumed row stream whose torn tail was cut off
            self._line(f"note: {event['text']}")
        elif kind == "verdict":
            label, verdict, figure = verdict_line(event["check"])
            tuning = self.budget_s is not None
            self.finished(
                f"numerics of {label}" if tuning else label,
                verdict,
                figure,
                index=None if tuning else event["index"],
                count=None if tuning else event["count"],
            )

    # ----------------------------------------------------------------
    def _line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, markup=False, soft_wrap=True)
            return
        file = self.err.file
        file.write(text + "\n")
        file.flush()
