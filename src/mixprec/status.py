"""The one status vocabulary of mixprec's results, and the tone every report shows it in.

Bench rows end ``ok``, ``unsupported``, ``oom``, ``error``, ``pruned`` or ``no-effect`` (a math
mode that computes what strict fp32 computes on this workload); checks ``pass`` or
``fail`` (or ``unsupported``); tune's decision table adds ``recommended``, ``passed``,
``rejected``, ``slower`` and ``unchecked``. Statuses are strings (``StrEnum``), so JSON
written by older versions and comparisons with plain strings keep working.
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
    PASS = "pass"
    FAIL = "fail"
    RECOMMENDED = "recommended"
    PASSED = "passed"
    REJECTED = "rejected"
    SLOWER = "slower"
    UNCHECKED = "unchecked"


# good: it works; best: the pick; bad: it failed; warn: it stopped short or was not judged;
# muted: not a candidate here.
TONES: dict[Status, str] = {
    Status.OK: "good",
    Status.PASS: "good",
    Status.PASSED: "good",
    Status.RECOMMENDED: "best",
    Status.FAIL: "bad",
    Status.REJECTED: "bad",
    Status.ERROR: "bad",
    Status.OOM: "bad",
    Status.PRUNED: "warn",
    Status.UNCHECKED: "warn",
    Status.UNSUPPORTED: "muted",
    Status.SLOWER: "muted",
    Status.NO_EFFECT: "muted",
}


def tone(status: str) -> str:
    """The tone of ``status`` ('muted' for anything unknown, e.g. from a newer file)."""
    try:
        return TONES[Status(status)]
    except ValueError:
        return "muted"
