"""What the parent and the script's agent say to each other, typed on both ends.

- the :class:`Plan` (parent -> child): a JSON file the child's environment names;
- a measured run's pipe (:mod:`.session`): the parent's :data:`GO` / :data:`STOP` lines, the
  child's :class:`Ready`, :class:`Step`, :class:`Done` and :class:`Failed` events, one JSON line each;
- a traced run's :class:`TraceRecord`, written with ``torch.save`` as plain data (tensors, numbers,
  strings, lists, dicts) and read back with ``weights_only=True``.

:class:`Facts` (what the script turned out to be) and :class:`Observed` (which dtype its first
matmul/conv computed in) travel inside them, and into ``mixprec run``'s run.json.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import torch

from mixprec.files import atomic_write_bytes
from mixprec.numerics.ranges import LayerRanges, RangeReport, TensorRange

PLAN_ENV = "MIXPREC_SCRIPT_PLAN"
OWNER_ENV = "MIXPREC_SCRIPT_OWNER"  # the process the plan is for (a spawned DataLoader worker is not)
GO, STOP = "go", "stop"  # the parent's words to a measured run: one more step, or stop here


@dataclasses.dataclass
class Plan:
    """What the parent asks of one run of the script.

    Attributes:
        mode: "measure" (steps paced by the parent over a pipe), "trace" (record ``steps`` steps for
            a numerics check, then stop), "run" (the user's run, to its end).
        candidate: the candidate's dict (:meth:`mixprec.Candidate.to_dict`); ``as_written`` runs the
            script's own precision.
        steps: "trace": the steps to record.
        read_fd / write_fd: "measure": the pipe ends to the parent (one process).
        channel: "measure" over a launch's ranks: the folder of the two FIFOs to the parent
            (``down``, read by rank 0; ``up``, written by every rank), whose descriptors no
            launcher hands its workers.
        world: the ranks the launch starts (1: one process).
        launched: the command is a launcher (torchrun, ``accelerate launch``) that starts the ranks:
            its own process, which imports mixprec's sitecustomize too, takes no agent.
        script: under a launcher, what each rank runs after the interpreter (``train.py args``,
            ``-m pkg.train args``): a rank is known by it where the launcher sets no ``LOCAL_RANK``.
        out: "trace": where the record goes (``torch.save``); "run": the folder for run.json.
        seed: seeds Python's, NumPy's and torch's generators before the script runs (None: the
            script's own randomness, as ``mixprec run`` leaves it).
        perturb: "trace": the initial weights times ``1 + perturb * N(0, 1)`` (the chaos floor).
        ranges: "trace": also the full per-layer ranges of the first step.
        scratch: where the frameworks' output folders go in "measure" and "trace" modes.
        home: "measure"/"trace": the user's folder, which the run's scratch working folder mirrors
            (:mod:`.sandbox`: reads as there, writes never there); None: no sandbox.
        own: mixprec's scratch folder (the trace and census records the parent reads are written
            there): never redirected by the sandbox, also where it lies in ``home`` (a script run
            from ``/tmp``).
        observer: "run": ``module:function`` building an observer of the run from the agent and
            ``observe`` (the monitor's adapter: :mod:`mixprec.monitor.script`), or None.
        observe: the observer's settings (the Monitor's: :class:`mixprec.monitor.MonitorConfig` fields).
        accumulate: micro-batches per optimizer step (gradient accumulation: :mod:`.accumulation` in a
            plain loop, the framework's own switch in the HF Trainer and Lightning); 1: none.
    """

    mode: str
    candidate: dict[str, Any]
    steps: int = 0
    read_fd: int | None = None
    write_fd: int | None = None
    channel: str | None = None
    world: int = 1
    launched: bool = False
    script: list[str] | None = None
    out: str | None = None
    seed: int | None = 0
    perturb: float = 0.0
    ranges: bool = False
    scratch: str | None = None
    home: str | None = None
    own: str | None = None
    observer: str | None = None
    observe: dict[str, Any] | None = None
    accumulate: int = 1

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self)), encoding="utf-8")

    @classmethod
    def from_env(cls) -> Plan | None:
        path = os.environ.get(PLAN_ENV)
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))


@dataclasses.dataclass
class Facts:
    """What the script turned out to be, read by the agent in its first steps.

    ``own`` is the script's own precision as written: ``{"autocast": [{"device_type", "dtype"}, ...],
    "scaler": bool | None, "framework": {flag: value}}`` (its frameworks' switches, or
    ``{"mixprec": policy}`` for mixprec's own Policy)."""

    model: str | None = None  # its class, or its parts' names and classes (None: no optimizer named it yet)
    device: str = "cpu"
    modules: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, class)
    params: list[str] = dataclasses.field(default_factory=list)
    param_dtypes: list[str] = dataclasses.field(default_factory=list)
    strict_math: bool = True  # the script's fp32 math mode is strict IEEE (before any candidate's)
    framework: str = "plain"
    framework_flags: dict[str, Any] = dataclasses.field(default_factory=dict)  # the switches mixprec set
    own: dict[str, Any] = dataclasses.field(default_factory=dict)
    unknown_frameworks: list[str] = dataclasses.field(default_factory=list)
    samples_per_step: int | None = None
    widened: bool = False  # a half-precision script's model, widened to fp32 for this candidate

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Facts:
        facts = cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
        facts.modules = [(str(m[0]), str(m[1])) for m in facts.modules]
        return facts


@dataclasses.dataclass
class Observed:
    """Which dtype the first matmul/conv layer of the script's first step computed in."""

    layer: str | None = None
    dtype: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"observed_layer": self.layer, "observed_dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Observed:
        data = data or {}
        return cls(data.get("observed_layer"), data.get("observed_dtype"))


@dataclasses.dataclass
class Step:
    """One optimizer step of the script: its wall time, samples, whether its update was skipped, its
    loss (None in run mode, where the observers read it); traced runs add the loss scale after it and
    ``stall``: (updates that rounded away, updates) under half weights."""

    kind: ClassVar[str] = "step"
    index: int
    seconds: float
    samples: int
    skipped: bool
    loss: float | None = None
    scale: float | None = None
    stall: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Step:
        step = cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
        step.stall = tuple(step.stall) if step.stall is not None else None  # type: ignore[assignment]
        return step


@dataclasses.dataclass
class Ready:
    """A measured run reached its first step: what the script is."""

    kind: ClassVar[str] = "ready"
    facts: Facts

    def to_dict(self) -> dict[str, Any]:
        return {"facts": self.facts.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ready:
        return cls(Facts.from_dict(data["facts"]))


@dataclasses.dataclass
class Done:
    """A measured run stopped at the parent's word: its peak memory and what really ran."""

    kind: ClassVar[str] = "done"
    peak_memory_bytes: int | None
    memory_method: str
    skipped_steps: int
    observed: Observed

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["observed"] = self.observed.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Done:
        return cls(
            data["peak_memory_bytes"],
            data["memory_method"],
            data["skipped_steps"],
            Observed.from_dict(data["observed"]),
        )


@dataclasses.dataclass
class Failed:
    """The agent stopped the script: mixprec's error type and message."""

    kind: ClassVar[str] = "error"
    type: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Failed:
        return cls(data["type"], data["message"])


@dataclasses.dataclass
class Ending:
    """A measured run ends here on the script's own account, not at its own end: why (the script
    starts a second model once done with the first: k-fold's next fold)."""

    kind: ClassVar[str] = "ending"
    why: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ending:
        return cls(data["why"])


Event = Step | Ready | Done | Failed | Ending
_EVENTS: dict[str, Any] = {e.kind: e for e in (Step, Ready, Done, Failed, Ending)}


def encode(event: Event) -> str:
    """One pipe line (newline included)."""
    return json.dumps({"event": event.kind, **event.to_dict()}) + "\n"


def decode(line: bytes | str) -> Event:
    data = json.loads(line)
    return _EVENTS[data.pop("event")].from_dict(data)


@dataclasses.dataclass
class TraceRecord:
    """What a traced run of the script recorded for the numerics check (or why it stopped)."""

    steps: list[Step] = dataclasses.field(default_factory=list)
    facts: Facts = dataclasses.field(default_factory=Facts)
    observed: Observed = dataclasses.field(default_factory=Observed)
    first_output: torch.Tensor | None = None
    first_grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    series: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # LayerSeries.to_dict()s
    nonfinite_buffers: list[str] = dataclasses.field(default_factory=list)
    ranges: RangeReport | None = None
    error: str | None = None  # "Type: message": the agent stopped the script

    def save(self, path: str) -> None:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update(
            steps=[s.to_dict() for s in self.steps],
            facts=self.facts.to_dict(),
            observed=self.observed.to_dict(),
            ranges=_report_state(self.ranges) if self.ranges is not None else None,
        )
        buffer = io.BytesIO()
        torch.save(data, buffer)
        # whole or not at all: the ranks of a launch may write one at once, and a reader never
        # sees half a record
        atomic_write_bytes(path, buffer.getvalue(), "trace record")

    @classmethod
    def load(cls, path: Path) -> TraceRecord:
        data = torch.load(path, weights_only=True)
        data.update(
            steps=[Step.from_dict(s) for s in data["steps"]],
            facts=Facts.from_dict(data["facts"]),
            observed=Observed.from_dict(data["observed"]),
            ranges=_report_from_state(data["ranges"]) if data["ranges"] is not None else None,
        )
        return cls(**data)


def _report_state(report: RangeReport) -> dict[str, Any]:
    """A RangeReport as plain data, every field of its TensorRanges kept (``to_dict`` derives some)."""

    def tensor_range(r: TensorRange) -> dict[str, Any]:
        return {**dataclasses.asdict(r), "dtypes": sorted(r.dtypes)}

    state = dataclasses.asdict(report)
    state["layers"] = [
        {**dataclasses.asdict(lr), "forward": tensor_range(lr.forward), "backward": tensor_range(lr.backward)}
        for lr in report.layers
    ]
    return state


def _report_from_state(state: dict[str, Any]) -> RangeReport:
    def tensor_range(d: dict[str, Any]) -> TensorRange:
        return TensorRange(**{**d, "dtypes": set(d["dtypes"])})

    layers = [
        LayerRanges(**{**d, "forward": tensor_range(d["forward"]), "backward": tensor_range(d["backward"])})
        for d in state["layers"]
    ]
    return RangeReport(**{**state, "layers": layers})
