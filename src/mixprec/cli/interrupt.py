"""A long command stopped by Ctrl-C keeps what it measured: the first interrupt (SIGINT or SIGTERM)
asks the work to stop at its next check, as if its budget were spent, so its result and outputs are
written as usual (and the command then exits 130 or 143); the second stops it at once."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType


class Interrupt:
    """What arrived: ``stop()`` is the work's poll; ``signal`` the first one's name, or ''."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.signal = ""

    def stop(self) -> bool:
        return bool(self.signal)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal:  # the second: stop now (cleanups run, children are stopped)
            from mixprec.cli import Terminated

            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.signal = signal.Signals(signum).name
        self.say(
            "interrupted: finishing the step under way, then writing what was measured (again: stop now)"
        )


@contextlib.contextmanager
def graceful(say: Callable[[str], None]) -> Iterator[Interrupt]:
    """The body's first SIGINT/SIGTERM sets :attr:`Interrupt.signal` instead of raising."""
    interrupt = Interrupt(say)
    if threading.current_thread() is not threading.main_thread():
        yield interrupt
        return
    previous = {sig: signal.signal(sig, interrupt._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield interrupt
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
