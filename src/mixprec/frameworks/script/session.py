"""The parent's side of a script run: a measured session paced step by step over a pipe
(:class:`ScriptSession`, what the paired sweep alternates), and a traced run for the numerics check
(:func:`trace`).

A session's child runs the script until its first optimizer step ends, reports it and waits; each
:meth:`ScriptSession.step` lets it run one more step. The strict-fp32 baseline's child and the
candidate's wait side by side, so their steps alternate on the same machine as every paired sweep's.

Every script stops at its own last step (its ``--steps``, ``max_iters``, epochs), and the strict-fp32
baseline steps through the whole sweep: a session whose script ends there starts it again and warms it
up untimed before the next timed step (the H200's script tune lost every row when a 200-step script
ended under its baseline).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import select
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from mixprec.errors import UsageError
from mixprec.frameworks.script.census import CENSUS_ENV, Convertible, ScriptCensus
from mixprec.frameworks.script.launch import Child, launch
from mixprec.frameworks.script.messages import (
    GO,
    STOP,
    Done,
    Ending,
    Event,
    Facts,
    Failed,
    Plan,
    Ready,
    Step,
    TraceRecord,
    decode,
)
from mixprec.frameworks.script.own import compute_dtype
from mixprec.frameworks.script.workload import ScriptWorkload
from mixprec.frameworks.session import BenchSettings, HonestyError, Measurement, SessionBase, steady
from mixprec.policy import Candidate
from mixprec.policy.registry import PolicySpec

# Seconds a script may take to reach its first optimizer step (imports, data, model, compile).
START_TIMEOUT_S = 600.0
# Seconds one more step may take.
STEP_TIMEOUT_S = 600.0


class ScriptFailed(UsageError):
    """The script stopped before mixprec had what it asked for; the message holds its last line."""


class ScriptTimedOut(ScriptFailed):
    """The script did not reach the steps asked for within the time it was given."""


class ScriptRanOut(ScriptFailed):
    """The script exited on its own with code 0: its loop ended (its own step count) before the
    steps asked for."""


ON_ITS_OWN = "the script ended on its own"


def _ended(child: Child, what: str, ending: str = ON_ITS_OWN) -> ScriptFailed:
    """Why the child is gone, in the script's own words where it left some (its log kept);
    ``ending``: why its agent said the run ends, where it did (a k-fold's second model)."""
    code = child.process.poll()
    last = child.last_error_line()
    child.discard(keep_log=True)
    said = f": {last}" if last else ""
    if code == 0:
        why = "the script ended" if ending == ON_ITS_OWN else f"{ending}, so its run ended"
        return ScriptRanOut(f"{why} before {what} (exit 0){said}")
    return ScriptFailed(f"the script stopped with exit code {code} before {what}{said} (log: {child.log})")


class ScriptSession(SessionBase):
    """A candidate's run of the script, one optimizer step at a time (the Session interface)."""

    def __init__(self, workload: ScriptWorkload, candidate: Candidate, settings: BenchSettings) -> None:
        self.workload, self.candidate, self.settings = workload, candidate, settings
        self.result = Measurement()
        self.index = 0
        self.script_steps: int | None = None  # the steps one run of the script reported, once it ended
        self.ending = ON_ITS_OWN  # why its runs end (its agent may say otherwise)
        self.restarts = 0
        self._earlier_skipped = 0  # steps the scaler skipped in the runs before this one
        self._plan = Plan(
            mode="measure",
            candidate=candidate.to_dict(),
            seed=settings.seed,
            accumulate=settings.accumulation_steps,
        )
        self._start()
        self.facts = self._ready.facts

    def _start(self) -> None:
        """Launch the script and wait for its first optimizer step (in :attr:`_first`)."""
        workload, plan = self.workload, self._plan
        self._child_steps = self._child_skipped = 0  # this run's optimizer steps reported, skipped
        if workload.launch is not None:  # a launch's ranks: FIFOs (no launcher hands its ranks our pipes)
            channel = workload.scratch / f"channel-{os.getpid()}-{time.monotonic_ns()}"
            channel.mkdir()
            os.mkfifo(channel / "down")
            os.mkfifo(channel / "up")
            # held open for reading and writing here: neither open waits for the rank's, and the
            # ranks' ends come and go (a rank that ends is seen by the launcher's exit, not an EOF)
            down_w = os.open(channel / "down", os.O_RDWR)
            up_r = os.open(channel / "up", os.O_RDWR | os.O_NONBLOCK)
            try:
                self.child = launch(workload, dataclasses.replace(plan, channel=str(channel)))
            except BaseException:  # (not started: our ends are closed here, none will use them)
                os.close(down_w)
                os.close(up_r)
                raise
        else:
            down_r, down_w = os.pipe()  # parent -> child
            up_r, up_w = os.pipe()  # child -> parent
            try:
                plan = dataclasses.replace(plan, read_fd=down_r, write_fd=up_w)
                self.child = launch(workload, plan, pass_fds=(down_r, up_w))
            finally:
                os.close(down_r)
                os.close(up_w)
        self._to = os.fdopen(down_w, "w", buffering=1)
        self._from = up_r  # read raw: a buffered reader would hide a second line from select()
        self._buffer = b""
        self._first: Step | None = None
        self._ready: Ready = self._expect(Ready, START_TIMEOUT_S, "its first optimizer step")
        self._first = self._expect(Step, STEP_TIMEOUT_S, "its first optimizer step")
        self._child_steps, self._child_skipped = 1, int(bool(self._first.skipped))

    def _expect(self, kind: type[Any], timeout_s: float, what: str) -> Any:
        event = self._next(timeout_s, what)
        while isinstance(event, Ending):  # (the run ends next: said why)
            self.ending = event.why
            event = self._next(timeout_s, what)
        if not isinstance(event, kind):
            raise ScriptFailed(f"the script's agent said {event.kind!r} before {what}, not {kind.kind!r}")
        return event

    def _next(self, timeout_s: float, what: str) -> Event:
        """The child's next event; ScriptFailed when it ends, errs or exceeds ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(keep_log=True)
                raise ScriptFailed(
                    f"the script did not reach {what} within {timeout_s:.0f} s (log: {self.child.log})"
                )
            if select.select([self._from], [], [], min(left, 0.5))[0]:
                chunk = os.read(self._from, 1 << 16)
                if not chunk:  # the child closed its end: it is gone
                    self.child.process.wait(timeout=30)
                    raise _ended(self.child, what, self.ending)
                self._buffer += chunk
            elif self.child.process.poll() is not None:
                raise _ended(self.child, what, self.ending)
        line, self._buffer = self._buffer.split(b"\n", 1)
        event = decode(line)
        if isinstance(event, Failed):
            self.child.process.wait(timeout=30)
            raise ScriptFailed(event.message)
        return event

    def step(self, timed: bool) -> dict[str, Any]:
        """One optimizer step of the script: its wall time, loss and samples."""
        try:
            step = self._next_step()
        except ScriptRanOut:
            if self.index < 2:  # (the first steps of a run: nothing to start again for)
                raise
            step = self._start_again()
        loss = step.loss if step.loss is not None else math.nan
        return self.recorded(step.seconds, loss, timed, skipped=step.skipped)

    def _next_step(self) -> Step:
        if self._first is not None:
            step, self._first = self._first, None
            return step
        self._command(GO, f"step {self.index}")
        step = self._expect(Step, STEP_TIMEOUT_S, f"step {self.index}")
        self._child_steps += 1
        self._child_skipped += int(bool(step.skipped))
        return step

    def _start_again(self) -> Step:
        """The script ended at its own last step: run it again, warmed up untimed as the first run
        was (its first steps compile, tune kernels, fill caches), and return its next step."""
        ended_after = self._child_steps
        self.script_steps = max(self.script_steps or 0, ended_after)
        self._earlier_skipped += self._child_skipped
        self.close(keep_log=False)
        # (its log was kept with the failed runs' when it ended: an end of its own is no failure)
        self.child.log.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # (only where it holds no other run's log)
            self.child.log.parent.rmdir()
        self.restarts += 1
        warm: list[float] = []
        try:
            self._start()
            while not steady(self.settings, warm):
                warm.append(self._next_step().seconds)
            return self._next_step()
        except ScriptRanOut:
            raise ScriptFailed(
                f"{self.ending}: after {ended_after} steps, too few to time it again after "
                f"its {len(warm)} warm-up steps: give it more steps (its --steps, max_iters or epochs)"
            ) from None

    def _command(self, word: str, what: str) -> None:
        """Tell the script ``word``; ScriptFailed (ScriptRanOut where it exited 0) where it is gone."""
        try:
            self._to.write(json.dumps({"cmd": word}) + "\n")
        except (BrokenPipeError, OSError, ValueError):  # (ValueError: our end already closed)
            stop(self.child.process)  # (it closed its end: it is ending, else it is ended now)
            raise _ended(self.child, what, self.ending) from None

    def finish(self) -> Measurement:
        """Stop the script at this step boundary; its peak memory and what really ran."""
        self._command(STOP, "stopping")
        done: Done = self._expect(Done, 60.0, "stopping")
        self.close()
        self.result.peak_memory_bytes = done.peak_memory_bytes
        self.result.memory_method = done.memory_method
        self.result.skipped_steps = done.skipped_steps + self._earlier_skipped
        if self.restarts:
            self.result.notes.append(
                f"{self.ending}: each run measured its first {self.script_steps} steps, started again "
                f"{self.restarts} time(s), each warmed up untimed"
            )
        self.result.observed_dtype, self.result.observed_layer = done.observed.dtype, done.observed.layer
        check_honesty(self.candidate, self.facts, self.result)
        return self.result

    def close(self, *, keep_log: bool = False) -> None:
        """End the child (its pipe closed: it stops at its next step) and remove its folder."""
        with contextlib.suppress(OSError):
            self._to.close()
        with contextlib.suppress(OSError):
            os.close(self._from)
        stop(self.child.process)
        self.child.discard(keep_log=keep_log)


def stop(process: Any, wait_s: float = 30.0) -> None:
    """Wait for ``process`` to end; after ``wait_s`` (or an interrupt) terminate it, then kill it:
    no script mixprec started outlives mixprec."""
    try:
        process.wait(timeout=wait_s)
        return
    except BaseException:
        process.terminate()
        try:
            process.wait(timeout=10)
        except BaseException:
            process.kill()
            process.wait()
        raise_if_interrupted()


def raise_if_interrupted() -> None:
    """Re-raise an interrupt being handled (``stop`` runs inside ``except BaseException``)."""
    import sys

    exc = sys.exc_info()[1]
    if isinstance(exc, KeyboardInterrupt):
        raise exc


def check_honesty(candidate: Candidate, facts: Facts, result: Measurement) -> None:
    """An injected candidate's first matmul/conv computed in its format (not the script's own
    autocast, not fp32 because autocast never reached the model)."""
    if candidate.as_written or result.observed_dtype is None:
        return
    expected = compute_dtype(candidate, facts.device)
    if result.observed_dtype != expected:
        raise HonestyError(
            f"labelled {candidate.label} but the script's first matmul/conv layer {result.observed_layer!r} "
            f"computed in {result.observed_dtype}, not {expected}: the candidate did not take effect "
            f"(the script trains through {facts.framework})"
        )


def trace(
    workload: ScriptWorkload,
    candidate: Candidate,
    steps: int,
    *,
    seed: int = 0,
    perturb: float = 0.0,
    ranges: bool = False,
    timeout_s: float | None = None,
    accumulate: int = 1,
) -> TraceRecord:
    """Run the script under ``candidate`` for ``steps`` optimizer steps, recording what a numerics
    check compares (losses, the first step's output and gradients, ranges); the record, or a
    ScriptFailed naming why the script stopped first. ``timeout_s``: the run's whole time (default:
    :data:`START_TIMEOUT_S` to the first step and :data:`STEP_TIMEOUT_S` a step after it).
    ``accumulate``: micro-batches per optimizer step (the plan's)."""
    out = workload.scratch / f"trace-{os.getpid()}-{time.monotonic_ns()}.pt"
    plan = Plan(
        mode="trace",
        candidate=candidate.to_dict(),
        steps=steps,
        out=str(out),
        seed=seed,
        perturb=perturb,
        ranges=ranges,
        accumulate=accumulate,
    )
    limit = timeout_s if timeout_s is not None else START_TIMEOUT_S + STEP_TIMEOUT_S * steps
    child = launch(workload, plan)
    try:
        child.process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        stop(child.process, 0)
        child.discard(keep_log=True)
        raise ScriptTimedOut(
            f"the script did not finish {steps} optimizer steps within {limit:.0f} s (log: {child.log})"
        ) from None
    except BaseException:
        stop(child.process, 0)
        child.discard()
        raise
    if not out.exists():
        raise _ended(child, f"{steps} optimizer steps")
    try:
        record = TraceRecord.load(out)
    except Exception as exc:  # a record the agent could not write whole
        child.discard(keep_log=True)
        raise ScriptFailed(f"the script's trace could not be read ({type(exc).__name__}: {exc})") from None
    finally:
        out.unlink(missing_ok=True)
    if record.error:
        child.discard(keep_log=True)
        raise ScriptFailed(record.error.split(": ", 1)[-1])
    child.discard()
    return record


def take_census(workload: Any, spec: PolicySpec, keep_fp32: Sequence[str] = ()) -> ScriptCensus:
    """One strict-fp32 step of the script with the Linear census of ``spec`` (:mod:`.census`;
    ``keep_fp32`` in fp32 islands, as the candidate keeps them); ScriptFailed where the script stops
    first."""
    from mixprec.frameworks.torch.linears import LinearCensus

    out = workload.scratch / f"census-{os.getpid()}-{time.monotonic_ns()}.json"
    request = {"policy": spec.name, "keep_fp32": list(keep_fp32), "out": str(out)}
    asking = dataclasses.replace(workload, env={**workload.env, CENSUS_ENV: json.dumps(request)})
    try:
        trace(asking, Candidate("fp32", framework="script"), 1)
        if not out.exists():
            raise ScriptFailed("the script's first step ended with no Linear census written")
        data = json.loads(out.read_text(encoding="utf-8"))
    finally:
        out.unlink(missing_ok=True)
    formats = {n: Convertible(**c) for n, c in data["formats"].items()}
    return ScriptCensus(LinearCensus.from_dict(data["census"]), formats)
