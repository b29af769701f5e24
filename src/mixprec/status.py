"""The one status vocabulary of mixprec's results, and the tone every report shows it in.

Bench rows end ``ok``, ``unsupported``, ``oom``, ``error``, ``pruned`` or ``no-effect`` (a math
mode that computes what strict fp32 computes on this workload), and in a precision x batch sweep
``over-budget`` (a micro-batch whose peak memory is past the budget, not timed); checks ``pass``,
``fail``, ``at-risk``, ``error``, ``unsupported`` or ``inconclusive`` (nothing failed, but the fp32
reference did not learn over the checked steps, so the comparison had no power: never a pass);
tune's decision table uses the checks' words for what passed and failed and adds
``recommended``, ``slower``, ``unchecked``, ``noisy`` (measured, passed, but too uncertain to rank:
set aside and re-measured when the budget allows), ``not-measured`` (planned, but the budget ended
before it ran) and ``predicted`` (numerics predicted here, speed not measurable).
Statuses are strings (``StrEnum``), so comparisons with plain strings keep working, and JSON
written by older versions loads: their ``passed`` and ``rejected`` read as ``pass`` and ``fail``.
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
    INCONCLUSIVE = "inconclusive"  # no failure seen, but the fp32 reference did not learn: never a pass
    AT_RISK = "at-risk"  # passes the checked steps, but a trend predicts a failure within the run
    RECOMMENDED = "recommended"
    SLOWER = "slower"
    UNCHECKED = "unchecked"
    NOISY = "noisy"  # passed, its speedup too uncertain to rank: set aside, re-measured if the budget allows
    NOT_MEASURED = "not-measured"  # planned, but the budget ended before it was measured
    PREDICTED = "predicted"  # numerics predicted on this machine; its speed cannot be measured here

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
    Status.INCONCLUSIVE: "warn",
    Status.AT_RISK: "bad",
    Status.ERROR: "bad",
    Status.OOM: "bad",
    Status.PRUNED: "warn",
    Status.UNCHECKED: "warn",
    Status.NOISY: "warn",
    Status.NOT_MEASURED: "warn",
    Status.PREDICTED: "muted",
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
