"""Process plumbing shared by the isolated and the data-parallel runners and the script agent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Keep multiprocessing from re-importing the caller's ``__main__`` script in the child.

    The child only needs ``_child`` (importable from mixprec) and the workload spec; re-running
    a user's script there would repeat its side effects, or recurse into the sweep when the
    script has no ``if __name__ == "__main__"`` guard. multiprocessing decides this from
    ``__main__.__spec__`` / ``__file__`` while ``Process.start()`` runs, so hide them just then.
    """
    main = sys.modules.get("__main__")
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__
    }
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the block runs, then deliver them to the handlers they had.

    multiprocessing's ``Process.start()`` stopped half-way leaves a fork-server child that never got
    its data: it prints an ``EOFError`` traceback over the command's clean exit (a SIGTERM landing
    as ``mixprec bench`` started its next candidate, tests/test_hardening.py). Handlers can only be
    set from the main thread; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, Any]] = []
    wanted = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: held.append((signum, frame))) for s in wanted}
    try:
        yield
    finally:
        for wanted_signal, handler in previous.items():
            signal.signal(wanted_signal, handler)
        for number, frame in held:
            handler = previous[signal.Signals(number)]
            if callable(handler):
                handler(number, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(number)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``).

    A candidate's parent is the fork server, which exits when mixprec does, also when mixprec is
    killed: the orphaned candidate then stops at once, silently, instead of training on until its
    next message hits a closed pipe. A no-op where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def current_rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    """This process's peak resident memory, in bytes: the kernel's high-water mark of its own
    address space (``VmHWM``). Not ``ru_maxrss``, which Linux carries across ``exec`` from the
    process that forked it: a script started by a 3.4 GB test worker read 3.4 GB at micro-batch 1."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # (kB)
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux; bytes on macOS)


# The name torch gives ProcessGroupGloo's worker threads (checked against torch 2.14).
GLOO_WORKER_THREAD = "pt_gloo_runloop"


def gloo_workers() -> dict[str, tuple[str, int]]:
    """This process's gloo worker threads, from ``/proc``: thread id -> (scheduler state, "R"
    running or waiting for a core, "S" asleep, ...; context switches so far). Empty where there are
    none, or no ``/proc``."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    found = {}
    for task in tasks:
        with contextlib.suppress(OSError, IndexError, ValueError):
            folder = f"/proc/self/task/{task}"
            with open(f"{folder}/comm", encoding="ascii", errors="replace") as f:
                if f.read().strip() != GLOO_WORKER_THREAD:
                    continue
            with open(f"{folder}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]  # (a thread's name may hold spaces)
            with open(f"{folder}/status", encoding="ascii", errors="replace") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
            found[task] = (state, switches)
    return found


def let_gloo_workers_finish(timeout_s: float = 2.0) -> bool:
    """Wait, the GIL let go, until this process's gloo worker threads look idle: each asleep, with no
    context switch over a window of two GIL switch intervals. True once they do (at once where there
    are none), False at ``timeout_s``. Best effort, from what ``/proc`` shows.

    Called at exit while the interpreter still runs (``atexit``). Why: torch 2.14's gloo worker lets
    go of a collective's work a moment after the caller has its result; where that drops the last
    reference to a tensor made in Python, freeing it takes the GIL, and once the interpreter has
    begun to shut down that stops the thread inside a ``noexcept`` destructor: the rank aborts
    (SIGABRT, "terminate called without an active exception"; pytorch#190489) after its last step,
    everything written. ``destroy_process_group()`` joins the workers only when nothing else holds
    the group (a DDP or FSDP2 model does). Why these looks: an idle worker sleeps on its queue with no
    timeout, so it does not switch; one waiting for the GIL sleeps too, but wakes once per switch
    interval to ask for it; one preempted is "R". Not waited for: a collective still in flight (an
    async one never waited for), asleep on its peer."""
    window = 2 * sys.getswitchinterval()
    deadline = time.monotonic() + timeout_s
    before = gloo_workers()
    while before:
        time.sleep(window)  # (lets go of the GIL: a worker waiting for it to free a tensor runs)
        now = gloo_workers()
        if now == before and all(state == "S" for state, _ in now.values()):
            return True
        if time.monotonic() >= deadline:
            return False
        before = now
    return True
