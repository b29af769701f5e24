"""A candidate's training session, stepped on command: in its own process or in this one.

Sweeps hold two sessions at once (the strict-fp32 baseline and the candidate being measured)
and alternate their steps, so both see the same machine at the same moments. A
:class:`ChildSession` runs in a process of its own (isolated peak memory, crash isolation, and a
step that runs far too long can be killed); a :class:`LocalSession` runs in this process (no
spec needed; a slow step is judged only when it ends). Both raise :class:`SessionEnded` when a
session stops early: pruned at a step limit, out of memory, crashed, or told to stop.

Children come from a ``forkserver`` that imported torch (and the workload's model library:
transformers, timm) once, so each starts in about a tenth of a second instead of re-importing
them, and no OpenMP thread pool is forked. What the workload's factory prints while a child
rebuilds it is captured and handed to the parent (``ChildSession.build_output``), never
repeated on the terminal once per candidate.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from mixprec.frameworks.base import SessionBuilder
from mixprec.frameworks.session import BenchSettings, Measurement, Session
from mixprec.measure.compile_cache import use_inductor_cache
from mixprec.measure.failure import exception_status, failure_status
from mixprec.policy import Candidate
from mixprec.process import current_rss_bytes, die_with_parent, main_module_hidden, peak_rss, signals_deferred
from mixprec.quiet import quiet_known_noise
from mixprec.workload import WorkloadSpec
from mixprec.workload.output import captured_fds

# The modules the fork server imports once (mixprec.measure.preload reads it there; never imported
# here: what it sets up, a quiet excepthook and tqdm's lock, is the fork server's alone).
PRELOAD_ENV = "MIXPREC_PRELOAD"

_CONTEXT: Any = None
_POLL_S = 0.2  # how often a wait looks at should_stop
TRACEBACK_FRAMES = 12  # innermost frames a failed session's traceback keeps

StepLimit = Callable[[int, bool], float | None]  # (step index, timed) -> seconds allowed, None = no limit
OnStep = Callable[[dict[str, Any]], None]


class SessionEnded(Exception):
    """The session stopped before it was finished; ``status`` is pruned, oom, error or stopped."""

    def __init__(
        self, status: str, reason: str, steps: list[float] | None = None, traceback: str = ""
    ) -> None:
        super().__init__(reason)
        self.status, self.reason, self.steps = status, reason, steps or []
        self.traceback = traceback  # where a failure happened (a child's is otherwise lost)


def _context(modules: tuple[str, ...] = ()) -> Any:
    """The fork server's context, started on first use with ``modules`` imported once (the
    framework, the model's library: ``Framework.preload``); a later sweep that needs others imports
    them in its children."""
    global _CONTEXT
    if _CONTEXT is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        # measure.preload imports the slow ones quietly (what they print was shown by this process)
        ctx.set_forkserver_preload(["mixprec.measure.preload"])
        before = os.environ.get(PRELOAD_ENV)
        os.environ[PRELOAD_ENV] = ",".join(modules)
        try:
            with main_module_hidden():
                forkserver.ensure_running()
        finally:
            if before is None:
                os.environ.pop(PRELOAD_ENV, None)
            else:
                os.environ[PRELOAD_ENV] = before
        _CONTEXT = ctx
    return _CONTEXT


def _error_event(exc: BaseException) -> dict[str, Any]:
    return {
        "event": "error",
        "type": type(exc).__name__,
        "message": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        # the innermost frames: where it failed, not how the child's command loop got there
        "traceback": _format(exc),
    }


def _child(
    conn: Any,
    spec: dict[str, Any],
    candidate: Candidate,
    settings: BenchSettings,
    build: SessionBuilder,
) -> None:
    """Child process body: build the session, then obey commands; errors are sent, never raised."""
    die_with_parent()
    quiet_known_noise()  # e.g. a compiling candidate's "No CUDA runtime" line on a CPU machine
    use_inductor_cache()  # a compile another candidate (or an earlier run) did is reused
    try:
        rss_before = current_rss_bytes()
        # The factory (and the optimizer factory) already ran, and printed, in the parent.
        with captured_fds() as output:
            session = build(spec, candidate, settings)
        conn.send({"event": "ready", "output": output.text})
        while True:
            command = conn.recv()
            if command["cmd"] == "warmup":
                session.warm_up(lambda event: conn.send(event) or True)
                conn.send({"event": "warm"})
            elif command["cmd"] == "steps":
                for _ in range(command["n"]):
                    conn.send(session.step(timed=True))
                conn.send({"event": "round"})
            else:  # finish
                result = session.finish()
                if result.peak_memory_bytes is None:
                    # (the fork server's own pages are already resident at start)
                    result.peak_memory_bytes = max(0, peak_rss() - rss_before)
                    result.memory_method = (
                        "peak RSS of the isolated candidate process minus its RSS before building"
                    )
                conn.send({"event": "done", "measurement": asdict(result)})
                return
    except (BrokenPipeError, ConnectionResetError, EOFError):
        # The parent is gone (killed): nobody to report to. Exit now, before interpreter shutdown
        # flushes streams whose readers may be gone too, so an orphan prints nothing.
        os._exit(0)
    except BaseException as exc:  # report everything, including OOM and KeyboardInterrupt
        with contextlib.suppress(BrokenPipeError, OSError):  # the parent is gone: nobody to tell
            conn.send(_error_event(exc))
    finally:
        conn.close()


class ChildSession:
    """A candidate's session in a child process, driven over a pipe."""

    def __init__(
        self,
        spec: WorkloadSpec,
        candidate: Candidate,
        settings: BenchSettings,
        *,
        build: SessionBuilder,
        preload: tuple[str, ...] = (),
        should_stop: Callable[[], bool] = lambda: False,
        start_timeout_s: float = 600.0,
    ) -> None:
        """``build`` makes the session in the child (the backend's ``session_builder``); ``preload``
        names the modules the fork server imports once (``Framework.preload``)."""
        self.candidate = candidate
        self.should_stop = should_stop
        self.steps_seen: list[float] = []
        self.build_output = ""  # what rebuilding the workload printed in the child
        ctx = _context(preload)
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_child, args=(child_conn, spec.to_dict(), candidate, settings, build), daemon=True
        )
        with main_module_hidden(), signals_deferred():  # (a start cut half-way: a child's traceback)
            self._proc.start()
        child_conn.close()
        self._next_index = 0
        event = self._wait(lambda: start_timeout_s, "building the workload")
        if event["event"] != "ready":
            raise SessionEnded("error", f"unexpected {event['event']!r} while building the workload")
        self.build_output = event.get("output", "")

    def _wait(self, limit: Callable[[], float | None], what: str) -> dict[str, Any]:
        """The next event from the child; :class:`SessionEnded` when it dies, errs, is stopped or
        exceeds ``limit()`` seconds."""
        since = time.perf_counter()
        while True:
            if self.should_stop():
                self.close()
                raise SessionEnded("stopped", "stopped by the deadline", self.steps_seen)
            allowed = limit()
            remaining = None if allowed is None else allowed - (time.perf_counter() - since)
            if remaining is not None and remaining <= 0:
                self.close()
                raise SessionEnded(
                    "pruned" if what.startswith("step") else "error",
                    f"{what} still running after {allowed:.1f} s",
                    self.steps_seen,
                )
            wait = _POLL_S if remaining is None else min(remaining, _POLL_S)
            if self._conn.poll(wait):
                try:
                    event = self._conn.recv()
                except EOFError:
                    raise self._died() from None
                if event["event"] == "error":
                    self.close()
                    raise SessionEnded(
                        failure_status(event["type"], event["message"]),
                        f"{event['type']}: {event['message']}",
                        self.steps_seen,
                        event.get("traceback", ""),
                    )
                return event
            if not self._proc.is_alive() and not self._conn.poll():
                raise self._died()

    def _run(
        self, command: dict[str, Any], end: str, limit: StepLimit, on_step: OnStep, timed: bool
    ) -> list[float]:
        self._conn.send(command)
        times: list[float] = []
        while True:
            index = self._next_index

            def allowed(index: int = index) -> float | None:
                return limit(index, timed)

            event = self._wait(allowed, f"step {index}")
            if event["event"] == end:
                return times
            times.append(event["seconds"])
            self.steps_seen.append(event["seconds"])
            self._next_index = event["index"] + 1
            on_step(event)

    def warm_up(self, limit: StepLimit, on_step: OnStep) -> list[float]:
        return self._run({"cmd": "warmup"}, "warm", limit, on_step, timed=False)

    def steps(self, n: int, limit: StepLimit, on_step: OnStep) -> list[float]:
        return self._run({"cmd": "steps", "n": n}, "round", limit, on_step, timed=True)

    def finish(self) -> Measurement:
        self._conn.send({"cmd": "finish"})
        event = self._wait(lambda: 120.0, "finishing")
        # let it exit on its own: a killed child leaks what its torch.compile worker pool holds
        self._proc.join(timeout=30)
        self.close()
        return Measurement(**event["measurement"])

    def _died(self) -> SessionEnded:
        self._proc.join(timeout=5)
        code = self._proc.exitcode
        self.close()
        if code is not None and code < 0 and -code == signal.SIGKILL:
            return SessionEnded(
                "oom", "candidate process was killed (SIGKILL): most likely out of memory", self.steps_seen
            )
        return SessionEnded("error", f"candidate process died with exit code {code}", self.steps_seen)

    def close(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=30)
        self._conn.close()


class LocalSession:
    """A candidate's session in this process: the same interface, limits judged after each step."""

    def __init__(
        self,
        candidate: Candidate,
        build: Callable[[], Session],
        *,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """``build`` makes the framework's session (``Framework.session``)."""
        self.candidate = candidate
        self.should_stop = should_stop
        self.steps_seen: list[float] = []
        self.build_output = ""  # nothing is rebuilt in this process
        try:
            self._session = build()
        except Exception as exc:
            raise SessionEnded(
                exception_status(exc),
                f"{type(exc).__name__}: {_first_line(exc)}",
                traceback=_format(exc),
            ) from exc

    def _ended_by(self, exc: Exception) -> SessionEnded:
        """The candidate's error row for ``exc``, with the steps it ran."""
        return SessionEnded(
            exception_status(exc), f"{type(exc).__name__}: {_first_line(exc)}", self.steps_seen, _format(exc)
        )

    def _step(self, timed: bool, limit: StepLimit, on_step: OnStep) -> dict[str, Any]:
        if self.should_stop():
            raise SessionEnded("stopped", "stopped by the deadline", self.steps_seen)
        index = self._session.index
        try:
            event = self._session.step(timed)
        except Exception as exc:  # one candidate's failure must not stop the sweep
            raise self._ended_by(exc) from exc
        self.steps_seen.append(event["seconds"])
        on_step(event)
        allowed = limit(index, timed)
        if allowed is not None and event["seconds"] > allowed:
            raise SessionEnded(
                "pruned",
                f"step {index} took {event['seconds']:.1f} s (limit {allowed:.1f} s)",
                self.steps_seen,
            )
        return event

    def warm_up(self, limit: StepLimit, on_step: OnStep) -> list[float]:
        times: list[float] = []
        while not self._session.warm_enough(times):
            times.append(self._step(False, limit, on_step)["seconds"])
        return times

    def steps(self, n: int, limit: StepLimit, on_step: OnStep) -> list[float]:
        return [self._step(True, limit, on_step)["seconds"] for _ in range(n)]

    def finish(self) -> Measurement:
        try:
            result = self._session.finish()
        except Exception as exc:  # (a script's candidate that did not take effect): a row, not the end
            raise self._ended_by(exc) from exc
        if result.peak_memory_bytes is None:
            result.memory_method = "n/a: in-process run (isolated CPU memory needs a workload spec)"
        return result

    def close(self) -> None:
        pass


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc, limit=-TRACEBACK_FRAMES))


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
