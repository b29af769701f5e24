"""What a user's code prints while mixprec builds it, kept from repeating once per candidate.

A model factory runs once in this process (where its output shows) and once more in every
candidate's child process; an optimizer factory runs once per candidate. Their output is the
same every time, so after the first it is captured: in a child at the file-descriptor level
(C extensions and logging handlers included), here at the Python level.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Captured:
    """The text a :func:`captured_fds` block wrote to stdout and stderr (filled in at its end)."""

    def __init__(self) -> None:
        self.text = ""


@contextlib.contextmanager
def captured_fds() -> Iterator[Captured]:
    """Send everything written to file descriptors 1 and 2 into a buffer for the duration.

    For a child process (one thread, nothing else writing): the Python streams are flushed
    before and after, so their buffered text lands in the capture, not after it.
    """
    result = Captured()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield result
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            result.text = sink.read().decode("utf-8", errors="replace")


@contextlib.contextmanager
def captured_streams() -> Iterator[io.StringIO]:
    """Python-level capture of ``print`` and ``warnings`` output (this process's other threads and
    C code still write through)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        yield buffer


def quiet_after_first(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` whose output shows on its first call and is captured (dropped) on later ones."""
    calls = 0

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args, **kwargs)
        with captured_streams():
            return fn(*args, **kwargs)

    return wrapper
