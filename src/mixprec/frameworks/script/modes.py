"""The three things a script run is for, one class each over the agent's shared core.

- :class:`Measure`: a candidate's steps paced by the parent over a pipe (the paired sweep);
- :class:`Trace`: ``steps`` steps recorded for the numerics check, then the script is stopped;
- :class:`Run`: the user's own run (``mixprec run``), to its end, watched by its observers, with
  run.json written at its exit.

The agent calls the same hooks in every mode; what a mode does at a step's end, at a failure and
at the exit is here, and nowhere else asks which mode runs.
"""

from __future__ import annotations

import atexit
import importlib
import json
import math
import os
from pathlib import Path
from typing import Any, ClassVar

import torch

from mixprec.frameworks.script.messages import (
    PLAN_ENV,
    STOP,
    Done,
    Ending,
    Event,
    Failed,
    Observed,
    Ready,
    Step,
    TraceRecord,
    encode,
)
from mixprec.frameworks.script.optimizers import scale_after
from mixprec.frameworks.script.own import compute_dtype
from mixprec.frameworks.script.ranks import Ranks
from mixprec.process import let_gloo_workers_finish, peak_rss

Agent = Any  # mixprec.frameworks.script.agent.Agent (which imports this module)

EXIT_REFUSED = 3  # `mixprec run`: the candidate did not take effect (what the CLI's 3 means)


class Mode:
    """What one kind of run does with the agent's events (module docstring)."""

    name: ClassVar[str]
    sandboxed: ClassVar[bool] = True  # writes go to a scratch mirror of the user's folder
    # started from a warm interpreter (launch, .forkserver): a run whose figures are its losses and
    # gradients. A timed and weighed run starts as the user's own does: a forked child's peak RSS
    # leaves out the library pages only the server's imports touched (0.87 -> 0.47 GB for a tiny CPU step).
    forked: ClassVar[bool] = False
    # a step with no backward() the agent saw is an error: nothing to compare (the user's own run
    # goes on: nothing is compared there)
    needs_backward: ClassVar[bool] = True

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.ranks = Ranks(agent.plan.world)  # this process's place in a launch run whole

    def install(self) -> None:
        """Before the script runs."""

    def probes(self) -> bool:
        """Whether the first step's compute dtype is read (for the record, or to stop a run)."""
        return True

    def discovered(self) -> None:
        """The model is known and the candidate applied."""

    def observed(self, observed: Observed) -> None:
        """The first step's compute dtype is known."""

    def step_ended(self, step: Step, loss: torch.Tensor | None) -> None:
        """A step ended (the scale updated, the step in ``agent.steps``)."""

    def new_model(self) -> None:
        """The script is done with its model and trains a new one (:meth:`Agent.new_model`)."""

    def fail(self, kind: str, message: str) -> None:
        """The agent stops the script with mixprec's reason: tell the parent."""

    def finish(self) -> None:
        """The script exits."""


class Measure(Mode):
    name = "measure"

    def install(self) -> None:
        plan = self.agent.plan
        if plan.channel is not None:  # a launch's ranks: every rank may report a failure, rank 0 steps
            self._out = open(Path(plan.channel) / "up", "w", buffering=1)  # noqa: SIM115 (lines < PIPE_BUF: whole)
            self._in = open(Path(plan.channel) / "down") if self.ranks.lead else None  # noqa: SIM115
        else:
            assert plan.read_fd is not None and plan.write_fd is not None
            self._out = os.fdopen(plan.write_fd, "w", buffering=1)
            self._in = os.fdopen(plan.read_fd, "r")

    def step_ended(self, step: Step, loss: torch.Tensor | None) -> None:
        """Report the step, then wait for the parent's next word (rank 0; the others for its word)."""
        step.loss = float(loss) if loss is not None else math.nan
        ranks, device = self.ranks, self.agent.device
        ranks.job_step(step, device)
        stop = True
        if self._in is not None:
            if step.index == 0:
                self.send(Ready(self.agent.facts()))
            self.send(step)
            line = self._in.readline()
            stop = not line or json.loads(line)["cmd"] == STOP
        if ranks.agree_stop(stop, device):
            done = self.done()
            if ranks.lead:
                self.send(done)
            self.agent.exit(0)

    def done(self) -> Done:
        device = self.agent.device
        if device.type == "cuda":
            peak, method = int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
        else:
            peak = peak_rss()
            method = "peak RSS of the script's process (the data, the interpreter and the libraries too)"
        if self.ranks.world > 1:
            peak, method = int(self.ranks.most(peak, device)), f"{method}, the fullest rank's"
        skipped = sum(1 for s in self.agent.steps if s.skipped)
        return Done(peak, method, skipped, self.agent.observed or Observed())

    def send(self, event: Event) -> None:
        self._out.write(encode(event))
        self._out.flush()

    def fail(self, kind: str, message: str) -> None:
        self.send(Failed(kind, message))

    def ending(self, why: str) -> None:
        """The run ends before the parent's word, not at the script's own end: say why."""
        self.send(Ending(why))


class Trace(Mode):
    name = "trace"
    forked = True

    def discovered(self) -> None:
        from mixprec.frameworks.script.tracing import Tracer

        agent = self.agent
        assert agent.model is not None
        compiled = bool(agent.candidate.compile) and agent.inject
        agent.tracer = Tracer(
            agent.model, agent.candidate.spec.range_format, compiled=compiled, ranges=agent.plan.ranges
        )

    def step_ended(self, step: Step, loss: torch.Tensor | None) -> None:
        agent = self.agent
        step.loss = float(loss) if loss is not None else math.nan  # (rank 0's is the one recorded)
        self.ranks.job_step(step, agent.device)
        if agent.tracer is not None:
            agent.tracer.end_step(step, scale_after(agent))
        if step.index + 1 >= agent.plan.steps:  # (every rank stops at this step: none waits)
            if self.ranks.lead:
                self.write(TraceRecord(agent.steps, agent.facts(), agent.observed or Observed()))
            agent.exit(0)

    def write(self, record: TraceRecord) -> None:
        agent = self.agent
        if agent.tracer is not None:
            agent.tracer.fill(record, agent.nonfinite_at_start)
        assert agent.plan.out
        record.save(agent.plan.out)

    def fail(self, kind: str, message: str) -> None:
        """Any rank's failure is the run's (the first written stays: the others follow from it)."""
        out = self.agent.plan.out
        if out and not (self.ranks.world > 1 and os.path.exists(out)):
            TraceRecord(facts=self.agent.facts(), error=f"{kind}: {message}").save(out)


class Run(Mode):
    name = "run"
    sandboxed = False
    needs_backward = False

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        self._finished = False

    def install(self) -> None:
        agent, plan = self.agent, self.agent.plan
        if plan.observer:  # built from the top (mixprec run): the monitor sits above this layer
            module, _, name = plan.observer.partition(":")
            agent.observers.append(getattr(importlib.import_module(module), name)(agent, plan.observe or {}))
        atexit.register(self.finish)
        agent.patches.on_exit(self.finish)

    def probes(self) -> bool:
        return self.agent.inject  # the script's own precision is what it is

    def observed(self, observed: Observed) -> None:
        """``mixprec run`` stops a run whose candidate did not take effect (fp32 training is never
        called bf16)."""
        agent = self.agent
        if observed.dtype is None:
            return
        with agent.internal():  # (the dtype the candidate computes matmuls in here: its own Policy's)
            expected = compute_dtype(agent.candidate, str(agent.device))
        computed = sorted(str(d).removeprefix("torch.") for d in agent.probe_dtypes)
        if expected not in computed:  # (a layer the model keeps in fp32 on purpose is not this)
            self.stop(
                f"labelled {agent.candidate.label} but no matmul/conv layer of the script's first step "
                f"computed in {expected} (they computed in {', '.join(computed)}; the first was "
                f"{observed.layer!r}): the candidate did not take effect in {agent.framework_title()}, so "
                "the run is stopped rather than trained in another precision than the one named",
                EXIT_REFUSED,
            )

    def step_ended(self, step: Step, loss: torch.Tensor | None) -> None:
        agent = self.agent
        for observer in agent.observers:
            with agent.internal():
                stop = observer.step(agent, loss, step.skipped)
            if stop:  # the observer gave up on the run: stop it, with the record
                self.stop(stop, 4)

    def new_model(self) -> None:
        """Each observer is done with the last model: one may give up on the run there (its
        monitor's closing read of the last losses), as at a step."""
        agent = self.agent
        for observer in agent.observers:
            with agent.internal():
                stop = observer.new_model(agent)
            if stop:
                self.stop(stop, 4)

    def fail(self, kind: str, message: str) -> None:
        self.stop(message, 2)

    def finish(self) -> None:
        """At the script's exit: its last step ends, and run.json is written."""
        agent = self.agent
        if self._finished or os.getpid() != agent.pid:
            return
        self._finished = True
        try:
            if agent.window.lead_stepped:
                agent.boundary()  # (on a launch's ranks: mixprec's own collectives, the job's last)
            self.write()
        finally:
            # at atexit, before the interpreter shuts down: a gloo worker still letting go of a
            # collective then aborts the rank (also after the script's destroy_process_group, which
            # its model can outlive); see let_gloo_workers_finish. (Before os._exit: no shutdown.)
            let_gloo_workers_finish()

    def stop(self, why: str, code: int) -> None:
        """End the run now with ``why`` in its record (the CLI prints it), exit ``code``."""
        self._finished = True
        self.write(error=why)
        self.agent.exit(code)

    def write(self, error: str | None = None) -> None:
        """run.json in the plan's folder: the candidate, the facts, the step times and each
        observer's summary (the monitor's losses, findings, health)."""
        agent = self.agent
        if not agent.plan.out:
            return
        out = Path(agent.plan.out)
        out.mkdir(parents=True, exist_ok=True)
        ranks = self.ranks
        data: dict[str, Any] = {
            "candidate": agent.candidate.to_dict(),
            "facts": agent.facts().to_dict(),
            "pid": os.getpid(),
            "plan": os.environ.get(PLAN_ENV),  # (whose run this is: a launch's ranks share its plan)
            "rank": ranks.rank,
            "world": ranks.world,
            "steps": len(agent.steps),
            "step_seconds": [s.seconds for s in agent.steps],
            "observed": (agent.observed or Observed()).to_dict(),
        }
        if error is not None:
            data["error"] = error
        for observer in agent.observers:
            with agent.internal():
                data.update(observer.summary())
        Path(ranks.own_path(str(out / "run.json"))).write_text(json.dumps(data, indent=1, default=str))


MODES: dict[str, type[Mode]] = {m.name: m for m in (Measure, Trace, Run)}


def mode_for(agent: Agent) -> Mode:
    return MODES[agent.plan.mode](agent)
