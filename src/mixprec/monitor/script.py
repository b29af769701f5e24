"""The monitor inside a training script run by ``mixprec run --monitor -- python train.py``: an
observer the script's agent (:mod:`mixprec.frameworks.script.agent`) calls once the model is found,
before each update of the script's step and at the end of each step.

It watches the script as :func:`mixprec.train` watches a Workload: before the update it hands the
monitor the step's loss and, in a plain loop, the step itself as a replayable tape
(:mod:`mixprec.frameworks.script.tape`: the model's calls and the script's loss head), so a spike or a
non-finite loss is replayed from the same weights in strict fp32 and in the policy and called data,
precision or transient, and, with ``rescue``, its update withheld (the BatchNorm statistics the bad
batch moved put back), an fp32 island made, or the update retried. A broken data pipeline is
stopped, and so is a run the monitor gives up on (exit 4, the reason in ``run.json``). The script's
own ``torch.save`` of the model's state is refused while that state holds inf/NaN (a finding, a line
on stderr; the run goes on). Findings go to ``events.jsonl``; ``run.json`` gets the losses, the
findings and the health. A script that trains one model after another (k-fold's folds) has each
watched by a monitor of its own, its findings tagged with the model's number (from 1), and
``run.json`` gets each model's record under ``models`` beside the run's losses, findings and health.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.core import Monitor
from mixprec.monitor.shadow import untouched


class ScriptMonitor:
    """A :class:`~mixprec.monitor.Monitor` over the script's model, policy and optimizers."""

    def __init__(self, agent: Any, settings: dict[str, Any]) -> None:
        settings = dict(settings)
        findings = settings.pop("findings", None)  # (each rank of a launch its own file)
        self.findings = agent.mode.ranks.own_path(findings) if findings else None
        if settings.get("rescue") and not settings.get("snapshot_every"):
            settings["snapshot_every"] = SNAPSHOT_EVERY  # poisoned weights roll back to one
        self.config = MonitorConfig(**settings)
        self.agent = agent
        self.monitor: Monitor | None = None
        # the records of the models the script trained before this one (their monitors let go: each
        # holds its model, its optimizers' state and a snapshot to roll back to)
        self.done: list[dict[str, Any]] = []
        self.model_number = 1  # which of the script's models this is (one the script never stepped counts)
        self._saves_guarded = False
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # this step's, before it
        self._checked = False  # whether the tape was checked against its step's own loss
        # the loss handed over before this step's update: recorded as is (the monitor keeps the value
        # it read then; another tensor of the same sum would be kept on a GPU and read again later)
        self._handed: torch.Tensor | None = None
        self.replay_note = ""  # why the steps cannot be replayed, where they cannot

    # ------------------------------------------------------------------ the agent's calls
    def discovered(self, agent: Any) -> None:
        """The model is known: the steps are taped where the shadow can replay them (a plain loop
        the candidate's Policy runs, not compiled), and the script's checkpoints are guarded."""
        agent.taping = agent.loop and not agent.candidate.compile
        if not agent.taping:
            self.replay_note = f"a loop trained by {agent.framework_title()} is not replayed"
        if self._saves_guarded:  # (the next of the script's models: guarded already)
            return
        self._saves_guarded = True
        original = torch.save
        monitor = self

        def save(obj: Any, f: Any, *args: Any, **kw: Any) -> Any:
            if not agent.internal_calls and monitor.refuses(obj, f):
                return None
            return original(obj, f, *args, **kw)

        agent.patches.replace(torch, "save", save)

    def forward(self, agent: Any, args: tuple, kwargs: dict) -> None:
        """A training forward of the model: the step's first keeps the buffers it may move."""
        if self._buffers is None and self.config.rescue:
            model = agent.model
            self._buffers = [
                (b, b.detach().clone()) for b in model.buffers() if b is not None and b.is_floating_point()
            ]

    def before_update(self, agent: Any) -> None:
        """The lead optimizer is about to apply the step's update: the loss and the step's tape to
        the monitor, which may withhold it (the optimizers' pre-step hooks)."""
        window = agent.window
        if not window.losses:
            return
        monitor = self.monitor or self._build(agent)
        loss = torch.stack([x.float().reshape(()) for x in window.losses]).sum()
        tape = window.tape
        if tape is not None and not self._checked:
            self._checked = True
            if not replays_its_step(tape, agent.model, monitor.autocast, float(loss)):
                self.replay_note = f"the script's step cannot be replayed: {tape.broken}"
                agent.taping = False
        replayable = tape is not None and not tape.broken and agent.taping
        self._handed = loss
        monitor.before_step(loss, tape if replayable else None, batch_index=window.index)

    def step(self, agent: Any, loss: torch.Tensor | None, skipped: bool) -> str | None:
        """Record the step; what stopped the run, if the monitor gave up on it."""
        buffers, self._buffers = self._buffers, None
        handed, self._handed = self._handed, None
        if loss is None:
            return None
        if self.monitor is None:  # (a framework's loop steps with a closure: no update seen before)
            self._build(agent)
        assert self.monitor is not None
        if buffers is not None and self.monitor.withheld and self.monitor.withheld[-1] == self.monitor.step:
            with torch.no_grad():  # the withheld batch's forward moved them: back as before it
                for live, saved in buffers:
                    live.copy_(saved)
        self.monitor.record(handed if handed is not None else loss)
        return f"the monitor stopped the run: {self.monitor.stopped}" if self.monitor.stopped else None

    def new_model(self, agent: Any) -> str | None:
        """The script is done with its model and trains a new one (k-fold's next fold): the last
        model's monitor is closed, its record kept and the monitor let go; the new one gets its own
        at its first update. What stopped the run, if the monitor gave up on it as it closed."""
        stop = None
        if self.monitor is not None:
            record = _record(self.monitor)  # (closes it: its last losses read)
            if self.monitor.stopped:
                stop = f"the monitor stopped the run: {self.monitor.stopped}"
            record["model"] = self.model_number
            if self.replay_note:
                record["replay"] = self.replay_note
            for finding in record["findings"]:  # (the first model's untagged as it ran: none other known)
                finding["evidence"].setdefault("model", self.model_number)
            self.done.append(record)
        self.model_number += 1
        self.monitor, self._buffers, self._handed, self._checked = None, None, None, False
        self.replay_note = ""
        return stop

    def summary(self) -> dict[str, Any]:
        records = list(self.done)
        if self.monitor is not None:
            record = _record(self.monitor)
            if self.done:
                record["model"] = self.model_number
                if self.replay_note:
                    record["replay"] = self.replay_note
            records.append(record)
        if not records:
            return {}
        if len(records) == 1:
            out = records[0]
            if self.replay_note:
                out["replay"] = self.replay_note
            return out
        return {
            "losses": [loss for r in records for loss in r["losses"]],
            "findings": [f for r in records for f in r["findings"]],
            "healthy": all(r["healthy"] for r in records),
            "withheld": [],  # (each model's own, under models: its steps counted from its own first)
            "models": records,
        }

    # ------------------------------------------------------------------ inside
    def _build(self, agent: Any) -> Monitor:
        """The Monitor, once the optimizers the script builds are all known (the first update).
        Whatever steps the script's optimizer is what it reads skips and the loss scale from: the
        candidate's Policy where it routes the steps, else the script's own enabled GradScaler (its
        replays still run under the candidate's autocast)."""
        own = next((s for s in agent.own.scalers if s.is_enabled()), None)
        policy = agent.policy if agent.policy is not None and (agent.routing or own is None) else None
        self.monitor = Monitor(
            agent.model,
            policy,
            optimizer=agent.optimizers.all,
            scaler=None if policy is not None else own,
            loss_fn=replay_step,
            autocast=agent.policy.autocast if agent.policy is not None and policy is None else None,
            config=self.config,
            findings=self.findings,
        )
        if self.model_number > 1:
            self.monitor.tags["model"] = self.model_number
        return self.monitor

    def refuses(self, obj: Any, f: Any) -> bool:
        """Whether the script's ``torch.save(obj, f)`` is a checkpoint of the model's state that
        holds inf/NaN now (then nothing is written: a finding, and a line on stderr)."""
        if self.monitor is None or not _holds_model_state(obj, self.agent.model):
            return False
        reason = self.monitor.checkpoint_refusal()
        if reason is None:
            return False
        print(f"mixprec: not saved to {f}: {reason}", file=sys.stderr, flush=True)
        return True


SNAPSHOT_EVERY = 50  # --rescue over a script: a snapshot to roll back to every this many steps


def replays_its_step(tape: Any, model: torch.nn.Module, context: Any, loss: float) -> bool:
    """Whether ``tape`` (before its update) gives back the step's own ``loss`` when replayed from the
    same weights and random state under the step's precision ``context``; one that does not is
    marked broken and never used."""
    if tape.broken:
        return False
    try:
        with untouched(model), torch.no_grad(), context():
            again = float(tape.replay(model))
    except Exception as exc:  # (its replay is evidence; a failing one must not stop the run)
        tape.broken = f"its replay failed ({type(exc).__name__}: {exc})"
        return False
    if again == loss or (math.isfinite(loss) and abs(again - loss) <= 1e-3 * max(abs(loss), 1e-6)):
        return True
    tape.broken = f"its replay gave loss {again:.6g}, not the step's {loss:.6g}"
    return False


def _record(monitor: Monitor) -> dict[str, Any]:
    """One model's monitor, closed: its losses, findings, health and withheld steps."""
    monitor.close()
    return {
        "losses": list(monitor.losses),
        "findings": [f.to_dict() for f in monitor.findings],
        "healthy": monitor.healthy,
        "withheld": list(monitor.withheld),
    }


def replay_step(model: Any, tape: Any) -> torch.Tensor:
    """The monitor's ``loss_fn`` for a script: the step's tape run again from the model as it is."""
    return tape.replay(model)


def _holds_model_state(obj: Any, model: torch.nn.Module) -> bool:
    """Whether ``obj`` (a state dict, a dict of them, the model) holds the model's own tensors."""
    own = {t.data_ptr() for t in (*model.parameters(), *model.buffers()) if t is not None}
    todo, depth = [obj], 0
    while todo and depth < 5:  # (a checkpoint nests its state dicts a few levels deep at most)
        later = []
        for item in todo:
            if isinstance(item, torch.nn.Module):  # (the model, a part of it, a module holding it)
                if any(t.data_ptr() in own for t in (*item.parameters(), *item.buffers())):
                    return True
            elif isinstance(item, torch.Tensor):
                if item.data_ptr() in own:
                    return True
            elif isinstance(item, dict):
                later += list(item.values())
            elif isinstance(item, (list, tuple)):
                later += list(item)
        todo, depth = later, depth + 1
    return False


def attach(agent: Any, settings: dict[str, Any]) -> ScriptMonitor:
    """The observer ``mixprec run --monitor`` names in the agent's plan."""
    return ScriptMonitor(agent, settings)
