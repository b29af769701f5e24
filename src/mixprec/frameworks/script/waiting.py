"""Waiting for the user's own run (``mixprec run``) as a terminal would.

The script runs in mixprec's process group, so a Ctrl-C typed at the terminal reaches it directly,
as it would without mixprec: the script's own ``except KeyboardInterrupt`` (a checkpoint saved on
the way out) runs, and mixprec waits for it to finish. Only a second Ctrl-C stops the script
(SIGTERM), and a third kills it. A SIGINT or SIGTERM sent to mixprec alone (``kill``), which the
script did not receive, is passed on to it.

The origin is read from the signal itself (``sigtimedwait``'s siginfo: the kernel's, from a
terminal). A signal sent to the process may also be taken by another of its threads (torch starts
threads at import, which do not block it), and then reaches mixprec through a Python handler,
without its siginfo; so where it is not Linux. There a SIGINT counts as the terminal's when mixprec
is the foreground job of its terminal (the script has it too), and is passed on otherwise. (Without
that handler a SIGINT another thread took raised KeyboardInterrupt in mixprec, which then waited for
a script that never got it: both ran on.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

_SI_KERNEL = 0x80  # siginfo's si_code of a signal the kernel sent: the terminal's Ctrl-C


def wait_run(process: subprocess.Popen, say: Callable[[str], None]) -> tuple[int, list[str]]:
    """Wait for ``process`` to end, handling signals meanwhile (module docstring); its exit code
    and the signals that arrived ("SIGINT", "SIGTERM"), in order."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "sigtimedwait"):
        return _wait_with_handlers(process, say)
    received: list[str] = []
    with _handled(process, received, say), _blocked((signal.SIGINT, signal.SIGTERM)):
        while process.poll() is None:
            info = signal.sigtimedwait([signal.SIGINT, signal.SIGTERM], 0.2)
            if info is None:
                continue
            name = signal.Signals(info.si_signo).name
            received.append(name)
            from_terminal = info.si_signo == signal.SIGINT and info.si_code == _SI_KERNEL
            _escalate(process, received, from_terminal, say)
    return process.wait(), received


def _escalate(
    process: subprocess.Popen, received: list[str], from_terminal: bool, say: Callable[[str], None]
) -> None:
    """The n-th signal: the first reaches the script (from the terminal it has it already), the
    second stops it, the third kills it."""
    if process.poll() is not None:
        return
    if len(received) == 1:
        if not from_terminal:
            process.send_signal(signal.SIGTERM if received[0] == "SIGTERM" else signal.SIGINT)
        say("waiting for your script to finish (interrupt again to stop it)")
    elif len(received) == 2:
        say("stopping your script (interrupt again to kill it)")
        process.terminate()
    else:
        process.kill()


def _wait_with_handlers(process: subprocess.Popen, say: Callable[[str], None]) -> tuple[int, list[str]]:
    received: list[str] = []
    with _handled(process, received, say):
        return process.wait(), received


@contextlib.contextmanager
def _handled(process: subprocess.Popen, received: list[str], say: Callable[[str], None]) -> Iterator[None]:
    """SIGINT and SIGTERM handled in Python in the body (from the main thread only: Python's rule),
    their origin judged without siginfo (module docstring)."""

    def handler(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        from_terminal = signum == signal.SIGINT and _foreground_of_a_terminal()
        _escalate(process, received, from_terminal, say)

    with contextlib.ExitStack() as stack:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous = signal.signal(sig, handler)
                stack.callback(signal.signal, sig, previous)
        yield


def _foreground_of_a_terminal() -> bool:
    """mixprec is its terminal's foreground job: a Ctrl-C typed there reached the script too."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


@contextlib.contextmanager
def _blocked(signals: tuple[int, ...]) -> Iterator[None]:
    """``signals`` held for ``sigtimedwait`` in the body (blocked after the child started: a child
    inherits its parent's mask)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        # a signal that arrived after the last wait is still pending: handled now, as usual
        pending = signal.sigpending() & set(signals)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if pending:  # pragma: no cover - a race at the very end of the run
            print(
                f"mixprec: {', '.join(sorted(s.name for s in pending))} at the end of the run",
                file=sys.stderr,
            )
