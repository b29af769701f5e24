"""Run one candidate in its own process: isolated peak memory, crash isolation, hard pruning.

Children come from a ``forkserver`` that imported torch once, so each candidate starts in
about a tenth of a second instead of re-importing torch, and no OpenMP thread pool is
forked. The child rebuilds the workload from its spec, reports every step over a pipe, and
is killed when a step runs far longer than the best candidate so far (pruned) or dies.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mixprec.measure.process import current_rss_bytes, main_module_hidden
from mixprec.measure.runner import BenchSettings, Measurement, run_candidate
from mixprec.policy import Candidate
from mixprec.workload import WorkloadSpec

_PRELOAD = ["torch", "torchvision", "mixprec.measure.runner", "mixprec.workload.loader"]
_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _child(conn: Any, spec: dict[str, Any], candidate: Candidate, settings: BenchSettings) -> None:
    """Child process body: everything it learns goes back over ``conn``; it never raises."""
    try:
        from mixprec.workload.loader import workload_from_spec

        rss_before = current_rss_bytes()
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
    status: str  # ok | error | oom | pruned | stopped (the caller's should_stop said so)
    reason: str = ""
    measurement: Measurement | None = None
    steps_seen: list[float] | None = None


_POLL_S = 0.2
StepTimeout = Callable[[int], float | None]  # step index -> seconds allowed, None = no limit
OnEvent = Callable[[dict[str, Any]], bool]  # False = prune now


def run_isolated(
    spec: WorkloadSpec,
    candidate: Candidate,
    settings: BenchSettings,
    *,
    step_timeout: StepTimeout,
    on_event: OnEvent,
    should_stop: Callable[[], bool] = lambda: False,
    start_timeout_s: float = 600.0,
) -> ChildOutcome:
    """Run ``candidate`` in a child process; prune it when a step exceeds ``step_timeout``.

    ``should_stop`` is polled about every 0.2 s while a step runs; when it says so the child is
    killed and the outcome is ``stopped``.
    """
    ctx = _context()
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child_conn, spec.to_dict(), candidate, settings), daemon=True)
    with main_module_hidden():
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
            if should_stop():
                return ChildOutcome("stopped", steps_seen=steps)
            if not parent_conn.poll(_POLL_S if remaining is None else min(remaining, _POLL_S)):
                if (remaining is None or remaining > _POLL_S) and proc.is_alive():
                    continue  # still within its limit: look at should_stop again
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
