"""The clock of one command: how long it may take, what is left, and what running out cut.

``bench``, ``check`` and ``tune`` take one :class:`Budget`. A stage that may take only part of it
gets a :meth:`~Budget.share` (the same clock, an earlier end); work that costs a known amount asks
:meth:`~Budget.can_pay` first; what the budget prevented is recorded with :meth:`~Budget.cut` (and
taken back with :meth:`~Budget.restore` when it is done after all), so a pick made without it can
say so. ``reserve_s`` is kept back at the end (deciding, linting, writing) by every share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from mixprec import clock
from mixprec.errors import UsageError

# How a note says that a signal (``Budget.interrupt``), not the clock, ended tune's work.
INTERRUPTED = "tune was interrupted"


def what_ended(interrupted: bool) -> str:
    """What ended the work first, as a note or a row's reason says it."""
    return INTERRUPTED if interrupted else "the budget ended"


@dataclass
class Budget:
    """Seconds for a command, counted from ``start`` (a :func:`mixprec.clock.now` value).

    Attributes:
        seconds: the whole budget; ``math.inf`` for none.
        reserve_s: kept back at the end: :meth:`left` and :meth:`expired` stop that much early.
        start: when the clock started.
        stop: polled by :meth:`expired` too: True stops the work as if the time were up.
        interrupt: polled as ``stop`` is, for a signal: it stops the work the same way, and what
            it cut is said to be the interrupt's, not the budget's (:meth:`ended_by`).
        cuts: what running out of time prevented, in order (shared by every share of this budget).
        end: when this budget (or share) ends; by default ``start + seconds``.
        fp32_only: the cuts that kept back fp32 work alone (its compiles): they cannot have kept a
            lower precision from being picked (shared like ``cuts``).
    """

    seconds: float = math.inf
    reserve_s: float = 0.0
    start: float = field(default_factory=lambda: clock.now())
    stop: Callable[[], bool] | None = None
    interrupt: Callable[[], bool] | None = None
    cuts: list[str] = field(default_factory=list)
    end: float | None = None
    fp32_only: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not (
            isinstance(self.seconds, (int, float)) and self.seconds > 0
        ):
            raise UsageError(f"budget must be a number of seconds > 0, got {self.seconds!r}.")
        if self.end is None:
            self.end = self.start + self.seconds

    @classmethod
    def unlimited(cls) -> Budget:
        return cls()

    @property
    def deadline(self) -> float:
        """The :func:`mixprec.clock.now` value at which work stops (the end minus the reserve)."""
        assert self.end is not None
        return self.end - self.reserve_s

    def elapsed(self) -> float:
        return clock.now() - self.start

    def left(self) -> float:
        """Seconds left before the deadline (negative once past it)."""
        return self.deadline - clock.now()

    def expired(self) -> bool:
        """The deadline has passed, or ``stop`` or ``interrupt`` asks to stop."""
        return self.left() <= 0 or self.asked_to_stop()

    def asked_to_stop(self) -> bool:
        """``stop`` or ``interrupt`` asks the work to stop, whatever time is left."""
        return bool(self.stop and self.stop()) or self.interrupted()

    def interrupted(self) -> bool:
        """``interrupt`` asks the work to stop: a signal arrived."""
        return bool(self.interrupt and self.interrupt())

    def ended_by(self) -> str:
        """What stops the work, as a note names it: "an interrupt", else "the deadline"."""
        return "an interrupt" if self.interrupted() else "the deadline"

    def unpaid(self) -> str:
        """Why work this budget did not pay for was left, as a note says it."""
        return INTERRUPTED if self.interrupted() else "budget spent (--budget raises it)"

    def why_ended(self, spent: str = "time budget spent") -> str:
        """Why work stopped early, as a note says it: "interrupted", else ``spent`` (the budget's words)."""
        return "interrupted" if self.interrupted() else spent

    def can_pay(self, cost_s: float) -> bool:
        """Whether work that costs about ``cost_s`` seconds fits in what is left."""
        return not self.expired() and self.left() >= cost_s

    def share(self, fraction: float) -> Budget:
        """The same clock ending at ``fraction`` of the whole budget (never after this one's end):
        what a stage may take first. Cuts recorded in the share are this budget's."""
        end = min(self.end or math.inf, self.start + fraction * self.seconds + self.reserve_s)
        return replace(self, end=end)

    def keeping(self, seconds: float) -> Budget:
        """The same clock ending ``seconds`` before this one's end: a stage that must leave time for
        the work after it (the late speed sweep, a numerics check)."""
        assert self.end is not None
        end = self.end - seconds
        return replace(self, end=end)

    def whole(self) -> Budget:
        """This budget to its end (a share taken back to the full length)."""
        return replace(self, end=None)  # (None: start + seconds)

    def cut(self, what: str, fp32_only: bool = False) -> None:
        """Record that running out of time prevented ``what`` (e.g. "the numerics of fp16-mixed");
        ``fp32_only``: what it prevented was fp32 work alone (said of every time it is cut)."""
        if what not in self.cuts:
            self.cuts.append(what)
            if fp32_only:
                self.fp32_only.add(what)
        if not fp32_only:
            self.fp32_only.discard(what)

    def restore(self, what: str) -> None:
        """``what`` was done after all: it no longer counts as cut."""
        if what in self.cuts:
            self.cuts.remove(what)
        self.fp32_only.discard(what)

    @property
    def cut_a_lower_precision(self) -> bool:
        """Whether a cut may have kept a lower precision than fp32 from being picked (any cut not
        known to be fp32's alone)."""
        return any(what not in self.fp32_only for what in self.cuts)
