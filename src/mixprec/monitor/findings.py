"""What the monitor concludes: one :class:`MonitorFinding` per event, classified, with its
evidence, and where it goes (a JSONL file, a callback, the framework's logger)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from mixprec import findings
from mixprec.files import check_regular_target

# The kinds of finding, each a different cause with a different cure.
SCALE_COLLAPSE = "scale_collapse"  # the loss scale keeps falling: gradients overflow at any scale
OVERFLOW = "overflow"  # a step overflowed in the policy's format, in a named module
PREDICTED_OVERFLOW = "predicted_overflow"  # a layer's range trend crosses the format's limit within the run
UNDERFLOW = "underflow"  # a growing share of a layer's gradients flushes to zero
STALL = "stall"  # half-precision weight updates rounded away
DRIFT = "drift"  # the fp32 shadow step disagrees more than at start-up
BAD_BATCH = "bad_batch"  # the fp32 shadow shows the same spike: the data, not the precision
SPIKE = "spike"  # the loss or gradient norm far above the run's range, diagnosed before its update
NONFINITE_WEIGHTS = "nonfinite_weights"  # weights or optimizer state hold inf/NaN
CHECKPOINT_REFUSED = "checkpoint_refused"  # a checkpoint of non-finite state was not written
RESCUE = "rescue"  # what the monitor changed about the run
SCHEDULE = "schedule"  # a planned precision switch
STOP = "stop"  # the rescues are spent and the run still fails, or the data is broken: the monitor stopped it
DIVERGENCE = "divergence"  # a layer's range trend passes fp32's own limit: the run diverges in any precision
UNWATCHED = "unwatched"  # the loop does not step the policy (or GradScaler) the monitor reads its skips from
REPLICAS_DIFFER = "replicas_differ"  # data-parallel replicas whose weights were to stay equal differ
KINDS = (
    SCALE_COLLAPSE,
    OVERFLOW,
    PREDICTED_OVERFLOW,
    UNDERFLOW,
    STALL,
    DRIFT,
    BAD_BATCH,
    SPIKE,
    NONFINITE_WEIGHTS,
    CHECKPOINT_REFUSED,
    RESCUE,
    SCHEDULE,
    STOP,
    DIVERGENCE,
    UNWATCHED,
    REPLICAS_DIFFER,
)
# Findings that blame the precision (a rescue may act on them); the others do not.
PRECISION_KINDS = (SCALE_COLLAPSE, OVERFLOW, PREDICTED_OVERFLOW, UNDERFLOW, STALL, DRIFT, NONFINITE_WEIGHTS)
# Findings that leave the run unhealthy until something answered them: the precision's, a spike
# (whatever its cause, its update damaged the run unless it was withheld, retried or rescued), a
# divergence (no precision answers it) and a loop the monitor cannot watch (it vouches for nothing).
OPEN_KINDS = (*PRECISION_KINDS, SPIKE, DIVERGENCE, UNWATCHED, REPLICAS_DIFFER)

# A spike's diagnosis (the ``verdict`` in its evidence): the replay of its batch from the same weights
# in fp32 and once more in the policy says which.
DATA = "data"  # fp32 spikes too: the batch
PRECISION = "precision"  # fp32 is fine, the policy spikes again: the precision (the module named)
TRANSIENT = "transient"  # neither replay spikes: a fault that does not reproduce
DIVERGED = "diverged"  # fp32 spikes too, and so does a batch that was normal: the weights, any precision
UNDIAGNOSED = "undiagnosed"  # no replay from the same weights was possible (no batch, or found late)


@dataclass(frozen=True)
class MonitorFinding(findings.Finding):
    """One thing the monitor saw, at one step: mixprec's :class:`~mixprec.findings.Finding` with
    the step and what the monitor did about it.

    Attributes:
        step: the training step (counted from 0) it was seen at.
        kind: one of :data:`KINDS`.
        message: one line, for a person.
        module: the module it is about, when there is one.
        evidence: the figures behind it (JSON-serialisable).
        action: what the monitor did about it ('' when it only alerts).
    """

    step: int
    kind: str
    message: str
    module: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    action: str = ""

    source = "monitor"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        where = f" [{self.module}]" if self.module else ""
        if "rank" in self.evidence:
            where += f" (rank {self.evidence['rank']})"
        if "model" in self.evidence:  # (a script that trains one model after another: k-fold's folds)
            where += f" (model {self.evidence['model']})"
        act = f" -> {self.action}" if self.action and self.action != self.message else ""
        return f"mixprec monitor: step {self.step}: {self.kind}{where}: {self.message}{act}"


Finding = MonitorFinding  # the name the monitor's users import


class JsonlSink:
    """Appends each finding as one JSON line to ``path`` (flushed, so a killed run keeps them)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = check_regular_target(path, "findings")  # not a folder or a link: refused now
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, finding: MonitorFinding) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(finding.to_json() + "\n")


Sink = Callable[[MonitorFinding], None]
