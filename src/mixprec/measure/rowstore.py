"""The row stream of a sweep: the ``.jsonl`` file every finished row is appended to at once.

Format: JSON Lines. The first line is a header naming the settings every figure depends on (the
resume key: workload and sizes, device, batch, steps, warm-up, min-time, threads, pruning,
isolation, ranks, torch and mixprec versions); every other line is one :class:`BenchRow`. Every
line carries a ``checksum`` of its content, so a torn or edited line is recognised on read.

Resuming a stream (:class:`RowStore` with ``resume=True``):

- a torn tail (a run killed mid-write) is truncated to the end of the last good line, and said so;
  corrupt lines elsewhere (not JSON, not an object, not UTF-8, a wrong checksum) are skipped;
- rows measured under other settings are refused, naming the settings that differ, unless
  ``resume_anyway``: then a new header marks where this run's rows begin.

While a sweep writes a stream it holds an exclusive ``flock`` on it: a second sweep on the same
file is refused instead of interleaving rows.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.errors import UsageError
from mixprec.files import open_regular
from mixprec.measure.results import STATUSES, BenchRow, sessions_fit
from mixprec.schema import SCHEMA_VERSION

HEADER_KIND = "mixprec-bench-rows"
CHECKSUM = "checksum"


def checksum(record: dict[str, Any]) -> str:
    """SHA-256 (first 16 hex digits) of ``record`` without its checksum, in canonical JSON."""
    body = {k: v for k, v in record.items() if k != CHECKSUM}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def encode(record: dict[str, Any]) -> bytes:
    """One line: ``record`` with its checksum, newline-terminated."""
    record = json.loads(json.dumps(record))  # the form a reader will parse (tuples -> lists)
    record[CHECKSUM] = checksum(record)
    return (json.dumps(record) + "\n").encode("utf-8")


def decode(line: bytes) -> dict[str, Any] | None:
    """The record of one line, or None when the line is not a valid, intact record."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    if CHECKSUM in record and record[CHECKSUM] != checksum(record):
        return None
    return record


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _well_typed(row: BenchRow) -> bool:
    """The fields later arithmetic relies on have the types the writer gives them."""
    optional_numbers = (row.first_step_ms, row.first_loss, row.wall_s, row.compute_share, row.optimizer_share)
    optional_ints = (row.peak_memory_bytes, row.flops_per_step, row.graph_breaks, row.graphs, row.recompiles)
    return (
        isinstance(row.workload, str)
        and isinstance(row.device, str)
        and isinstance(row.batch_size, int)
        and not isinstance(row.batch_size, bool)
        and row.batch_size >= 1
        and isinstance(row.world_size, int)
        and row.world_size >= 1
        and row.status in STATUSES
        and isinstance(row.reason, str)
        and isinstance(row.baseline_repeat, bool)
        and all(_is_number(t) and t >= 0 for t in row.step_times_ms)
        and all(_is_number(t) for t in (*row.paired_ratios, *row.rank_step_time_ms))
        and (not row.sessions or sessions_fit(len(row.paired_ratios), row.sessions))
        and all(v is None or _is_number(v) for v in optional_numbers)
        and all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in optional_ints)
        and all(v is None or isinstance(v, int) for v in row.rank_peak_memory_bytes)
        and all(isinstance(n, str) for n in row.notes)
        and (row.observed_dtype is None or isinstance(row.observed_dtype, str))
        and isinstance(row.memory_method, str)
    )


def _row(record: dict[str, Any]) -> BenchRow | None:
    try:
        row = BenchRow.from_dict(record)
    except Exception:  # any malformed row (wrong types, unknown policy) is a corrupt line
        return None
    return row if _well_typed(row) else None


@dataclass
class Scan:
    """What a stream holds: its rows, under which header each was written, and where it is damaged.

    Attributes:
        rows: the intact rows, in file order.
        row_headers: per row, the index into ``headers`` of the header above it (-1: none).
        headers: the settings of every header line, in file order.
        good_end: byte offset just after the last intact line.
        torn_bytes: bytes after ``good_end`` (a torn last line, or trailing garbage).
        skipped: corrupt lines before ``good_end``.
        unterminated: the last intact line has no newline (it must get one before appending).
    """

    rows: list[BenchRow] = field(default_factory=list)
    row_headers: list[int] = field(default_factory=list)
    headers: list[dict[str, Any]] = field(default_factory=list)
    good_end: int = 0
    torn_bytes: int = 0
    skipped: int = 0
    unterminated: bool = False


def scan(data: bytes) -> Scan:
    """Parse a stream's bytes; never raises."""
    out = Scan()
    offset = 0
    bad_since_good = 0
    for raw in data.split(b"\n"):
        end = offset + len(raw)
        newline = end < len(data)
        if raw.strip():
            record = decode(raw)
            good = False
            if record is not None and record.get("kind") == HEADER_KIND:
                settings = record.get("settings")
                if isinstance(settings, dict):
                    out.headers.append(settings)
                    good = True
            elif record is not None and record.get("kind") is None:
                row = _row(record)
                if row is not None:
                    out.rows.append(row)
                    out.row_headers.append(len(out.headers) - 1)
                    good = True
            if good:
                out.skipped += bad_since_good
                bad_since_good = 0
                out.good_end = end + (1 if newline else 0)
                out.unterminated = not newline
            else:
                bad_since_good += 1
        offset = end + 1
    out.torn_bytes = len(data) - out.good_end
    return out


def read_jsonl(path: str | os.PathLike[str]) -> list[BenchRow]:
    """The intact rows of a stream (headers, torn and corrupt lines left out); [] when absent."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UsageError(f"cannot read rows file {str(path)!r}: {exc.strerror or exc}.") from None
    return scan(data).rows


def resumed_threads(path: str | os.PathLike[str]) -> int | None:
    """The intra-op thread count the last row of the stream at ``path`` was measured at (the count
    in its header), or None: no stream, no rows, or no count recorded."""
    try:
        found = scan(Path(path).read_bytes())
    except OSError:  # (a stream that cannot be read is the RowStore's to refuse, with its reason)
        return None
    if not found.rows or found.row_headers[-1] < 0:
        return None
    threads = found.headers[found.row_headers[-1]].get("threads")
    return threads if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0 else None


def _normalised(settings: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(settings))


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    keys = [*new, *(k for k in old if k not in new)]
    return [f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in keys if old.get(k) != new.get(k)]


class RowStore:
    """A sweep's open row stream: locked, recovered on resume, appended to row by row.

    Args:
        path: the ``.jsonl`` file.
        settings: the resume key (see the module docstring); JSON-serialisable.
        resume: keep the rows already there (after recovery and the settings check);
            otherwise the file starts over.
        resume_anyway: keep rows measured under other settings too (a new header marks the change).

    Attributes:
        rows: the rows kept from an earlier run (resume only).
        notes: what recovery did and what was kept, one line each.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        settings: dict[str, Any],
        *,
        resume: bool,
        resume_anyway: bool = False,
    ) -> None:
        self.path = Path(path)
        self.settings = _normalised(settings)
        self.rows: list[BenchRow] = []
        self.notes: list[str] = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"rows file {str(self.path)!r}: cannot create its folder ({exc.strerror or exc})."
            ) from None
        self._fd: int | None = open_regular(self.path, os.O_RDWR | os.O_CREAT, "rows file")
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UsageError(
                    f"another run is writing rows to {str(self.path)!r}; wait for it to finish, or pass "
                    "another output path (--json)."
                ) from None
            if resume:
                self._recover(resume_anyway)
            else:
                os.ftruncate(self._fd, 0)
                self._write(self._header())
        except BaseException:
            self.close()
            raise

    def _header(self) -> bytes:
        return encode({"kind": HEADER_KIND, "schema_version": SCHEMA_VERSION, "settings": self.settings})

    def _read_all(self) -> bytes:
        assert self._fd is not None
        chunks = []
        offset = 0
        while chunk := os.pread(self._fd, 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    def _recover(self, resume_anyway: bool) -> None:
        assert self._fd is not None
        found = scan(self._read_all())
        name = str(self.path)
        stale = self._stale(found)
        if stale and not resume_anyway:  # refused before anything in the file changes
            raise UsageError(
                f"--resume refused: {stale}; rerun with the same settings, or without --resume to "
                "measure again, or pass --resume-anyway (resume_anyway=True) to keep them."
            )
        if stale:
            self.notes.append(f"resumed anyway: {stale}")
        if found.torn_bytes:
            os.ftruncate(self._fd, found.good_end)
            self.notes.append(
                f"recovered {name}: dropped {found.torn_bytes} bytes of a torn or corrupt last line "
                "(the run writing it was killed); that row is measured again"
            )
        if found.unterminated:
            self._write(b"\n")
        if found.skipped:
            self.notes.append(f"{name}: skipped {found.skipped} corrupt line(s) (bad JSON or checksum)")
        if not found.headers or found.headers[-1] != self.settings:
            self._write(self._header())
        self.rows = found.rows

    def _stale(self, found: Scan) -> str:
        """Why the rows found cannot be compared with this run's, or '' when they can."""
        if not found.rows:
            return ""
        name = str(self.path)
        if any(h < 0 for h in found.row_headers):
            return (
                f"{name} holds rows without a settings header (written by an older mixprec), so the "
                "settings they were measured under are unknown"
            )
        used = {found.row_headers[i] for i in range(len(found.rows))}
        for index in sorted(used):
            diff = _differences(_normalised(found.headers[index]), self.settings)
            if diff:
                return f"{name} holds rows measured under other settings: {', '.join(diff)}"
        return ""

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        end = os.lseek(self._fd, 0, os.SEEK_END)
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, end)
            view, end = view[written:], end + written

    def append(self, row: BenchRow) -> None:
        """Append one row and fsync, so a crash or Ctrl-C right after loses nothing."""
        if self._fd is None:
            raise UsageError(f"rows file {str(self.path)!r} is closed.")
        self._write(encode(row.to_dict()))
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing drops the lock
            self._fd = None

    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
