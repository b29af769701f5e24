"""Run one candidate in its own process: isolated peak memory, crash isolation, hard pruning.

Children come from a ``forkserver`` that imported torch once, so each candidate starts in
about a tenth of a second instead of re-importing torch, and no OpenMP thread pool is
forked. The child rebuilds the workload from its spec, reports every step over a pipe, and
is killed when a step runs far longer than the best candidate so far (pruned) or dies.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from mixprec.measure.results import Candidate
from mixprec.measure.runner import BenchSettings, Measurement, run_candidate
from mixprec.workload import WorkloadSpec

_PRELOAD = ["torch", "torchvision", "mixprec.measure.runner", "mixprec.workload_loader"]
_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Keep multiprocessing from re-importing the caller's ``__main__`` script in the child.

    The child only needs ``_child`` (importable from mixprec) and the workload spec; re-running
    a user's script there would repeat its side effects, or recurse into the sweep when the
    script has no ``if __name__ == "__main__"`` guard. multiprocessing decides this from
    ``__main__.__spec__`` / ``__file__`` while ``Process.start()`` runs, so hide them just then.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _current_rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _child(conn: Any, spec: dict[str, Any], candidate: Candidate, settings: BenchSettings) -> None:
    """Child process body: everything it learns goes back over ``conn``; it never raises."""
    try:
        from mixprec.workload_loader import workload_from_spec

        rss_before = _current_rss_bytes()
        workload = workload_from_spec(
            WorkloadSpec(spec["kind"], spec["target"], tuple(spec["sizes"].items()))
        )

        def emit(event: dict[str, Any]) -> bool:
            conn.send(event)
            return True

        result = run_candidate(workload, candidate, settings, emit)
        if result.peak_memory_bytes is None:
            # ru_maxrss is KiB on Linux; the fork server's own pages are already resident at start.
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            result.peak_memory_bytes = max(0, peak - rss_before)
            result.memory_method = "peak RSS of the isolated candidate process minus its RSS before building"
        conn.send({"event": "done", "measurement": asdict(result)})
    except BaseException as exc:  # report everything, including OOM and KeyboardInterrupt
        conn.send(
            {
                "event": "error",
                "type": type(exc).__name__,
                "message": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                "traceback": traceback.format_exc(limit=8),
            }
        )
    finally:
        conn.close()


@dataclass
class ChildOutcome:
    status: str  # ok | error | oom | pruned
    reason: str = ""
    measurement: Measurement | None = None
    steps_seen: list[float] | None = None


StepTimeout = Callable[[int], float | None]  # step index -> seconds allowed, None = no limit
OnEvent = Callable[[dict[str, Any]], bool]  # False = prune now


def run_isolated(
    spec: WorkloadSpec,
    candidate: Candidate,
    settings: BenchSettings,
    *,
    step_timeout: StepTimeout,
    on_event: OnEvent,
    start_timeout_s: float = 600.0,
) -> ChildOutcome:
    """Run ``candidate`` in a child process; prune it when a step exceeds ``step_timeout``."""
    ctx = _context()
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child_conn, spec.to_dict(), candidate, settings), daemon=True)
    with _main_module_hidden():
        proc.start()
    child_conn.close()
    steps: list[float] = []
    next_index = 0
    ready = False  # the child has rebuilt the workload; from now on steps are timed
    waited_since = time.perf_counter()
    try:
        while True:
            limit = step_timeout(next_index) if ready else start_timeout_s
            remaining = None if limit is None else max(0.0, limit - (time.perf_counter() - waited_since))
            if not parent_conn.poll(remaining):
                if not proc.is_alive():
                    return _died(proc, steps)
                if not ready:
                    return ChildOutcome("error", f"workload not built within {limit:.0f} s", steps_seen=steps)
                return ChildOutcome(
                    "pruned",
                    f"step {next_index} still running after {limit:.1f} s, far slower than the best "
                    "candidate so far",
                    steps_seen=steps,
                )
            try:
                event = parent_conn.recv()
            except EOFError:
                return _died(proc, steps)
            if event["event"] == "ready":
                ready = True
                waited_since = time.perf_counter()
                on_event(event)
            elif event["event"] == "step":
                steps.append(event["seconds"])
                next_index = event["index"] + 1
                waited_since = time.perf_counter()
                if not on_event(event):
                    return ChildOutcome("pruned", "", steps_seen=steps)
            elif event["event"] == "done":
                return ChildOutcome("ok", measurement=Measurement(**event["measurement"]), steps_seen=steps)
            elif event["event"] == "error":
                status = "oom" if "OutOfMemory" in event["type"] else "error"
                return ChildOutcome(status, f"{event['type']}: {event['message']}", steps_seen=steps)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=30)
        parent_conn.close()


def _died(proc: Any, steps: list[float]) -> ChildOutcome:
    proc.join(timeout=5)
    code = proc.exitcode
    if code is not None and code < 0 and -code == signal.SIGKILL:
        return ChildOutcome(
            "oom", "candidate process was killed (SIGKILL): most likely out of memory", steps_seen=steps
        )
    return ChildOutcome("error", f"candidate process died with exit code {code}", steps_seen=steps)
