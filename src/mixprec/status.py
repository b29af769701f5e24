"""The one status vocabulary of mixprec's results, and the tone every report shows it in.

Bench rows end ``ok``, ``unsupported``, ``oom``, ``error``, ``pruned`` or ``no-effect`` (a math
mode that computes what strict fp32 computes on this workload), and in a precision x batch sweep
``over-budget`` (a micro-batch whose peak memory is past the budget, not timed); checks ``pass``
or ``fail`` (or ``unsupported``); tune's decision table uses the checks' words for what passed
and failed and adds ``recommended``, ``slower`` and ``unchecked``. Statuses are strings
(``StrEnum``), so comparisons with plain strings keep working, and JSON written by older versions
loads: their ``passed`` and ``rejected`` read as ``pass`` and ``fail``.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    OK = "ok"
    UNSUPPORTED = "unsupported"
    OOM = "oom"
    ERROR = "error"
    PRUNED = "pruned"
    NO_EFFECT = "no-effect"
    OVER_BUDGET = "over-budget"  # precision x batch: its measured peak is past the memory budget (not timed)
    PASS = "pass"
    FAIL = "fail"
    AT_RISK = "at-risk"  # passes the checked steps, but a trend predicts a failure within the run
    RECOMMENDED = "recommended"
    SLOWER = "slower"
    UNCHECKED = "unchecked"

    @classmethod
    def _missing_(cls, value: object) -> Status | None:
        """Older files' decision-table words: 'passed' and 'rejected' are 'pass' and 'fail'."""
        return {"passed": cls.PASS, "rejected": cls.FAIL}.get(str(value).lower())


# good: it works; best: the pick; bad: it failed; warn: it stopped short or was not judged;
# muted: not a candidate here.
TONES: dict[Status, str] = {
    Status.OK: "good",
    Status.PASS: "good",
    Status.RECOMMENDED: "best",
    Status.FAIL: "bad",
    Status.AT_RISK: "bad",
    Status.ERROR: "bad",
    Status.OOM: "bad",
    Status.PRUNED: "warn",
    Status.UNCHECKED: "warn",
    Status.UNSUPPORTED: "muted",
    Status.SLOWER: "muted",
    Status.NO_EFFECT: "muted",
    Status.OVER_BUDGET: "muted",
}


def read_status(value: object) -> str:
    """A status read from a file: the :class:`Status` it names (older words included), or the text
    as it is when it names none (a newer file's)."""
    try:
        return Status(str(value))
    except ValueError:
        return str(value)


def tone(status: str) -> str:
    """The tone of ``status`` ('muted' for anything unknown, e.g. from a newer file)."""
    try:
        return TONES[Status(status)]
    except ValueError:
        return "muted"
