"""Imported by the candidates' fork server before it forks any child.

The slow imports a workload needs (transformers, timm: seconds each) are named in
``MIXPREC_PRELOAD`` by the sweep (``Framework.preload``; :mod:`mixprec.measure.isolate`) and
imported here once, so every candidate's child starts with them loaded. Whatever they print
while importing is dropped: the parent process, which imported them too, has already shown it.

A child whose sweep was killed while it started (before it was sent its work) or while it ran ends
on a closed pipe; it has no one to report to, so that ends it silently (:func:`_quiet_when_orphaned`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from types import TracebackType

from mixprec.measure.isolate import PRELOAD_ENV
from mixprec.workload.output import captured_fds

# What reading from or writing to a pipe whose other end is gone raises.
_PARENT_GONE = (EOFError, BrokenPipeError, ConnectionResetError)
_default_hook = sys.excepthook


def _quiet_when_orphaned(
    kind: type[BaseException], error: BaseException, traceback: TracebackType | None
) -> None:
    """The fork server's (and so every child's) hook for an exception nothing caught: silent for a
    closed pipe. A sweep SIGKILLed as it asked for a candidate's process left that child reading
    its work from a pipe with no writer, and its EOFError traceback reached the user's terminal."""
    if not issubclass(kind, _PARENT_GONE):
        _default_hook(kind, error, traceback)


def _share_tqdms_lock() -> None:
    """Make tqdm's lock here, for every child to inherit. tqdm makes a multiprocessing lock (a named
    POSIX semaphore) at a process's first progress bar, and torch.fx's interpreter makes a disabled
    one while compiling: made in a candidate's child that the budget then stopped mid-compile
    (SIGKILL), it was left to the resource tracker, which printed "There appear to be 1 leaked
    semaphore objects to clean up at shutdown" on the user's terminal as the tune ended (the default
    ResNet-50 tune on the EPYC, two runs of three). Made here, the children inherit it and make none
    of their own to leave behind."""
    with contextlib.suppress(Exception):  # (no tqdm: nothing makes that lock)
        from tqdm import tqdm

        tqdm.get_lock()


sys.excepthook = _quiet_when_orphaned
_share_tqdms_lock()

for _name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
    # A module that fails here is imported (and its error reported) in the child that needs it.
    with captured_fds(), contextlib.suppress(Exception):
        importlib.import_module(_name)
