"""What crosses the seam between a framework's training session and mixprec's measuring: the
settings a session runs under, the :class:`Measurement` it returns, the :class:`Session` interface
the paired sweep drives, and the errors a step may raise.

Every framework backend (:class:`mixprec.frameworks.Framework`) builds sessions with this interface;
the sweep, its child processes and its pruning never look past it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from mixprec.errors import MixprecError, UsageError

# How many distinct batches to cycle through: same data for every candidate, bounded memory.
_DISTINCT_BATCHES = 4
# Warm-up is steady when the last two step times differ by at most this share; never more steps.
STEADY_TOLERANCE = 0.10
MAX_WARMUP = 8


class HonestyError(MixprecError):
    """What ran is not what the row would claim (e.g. autocast silently did nothing)."""


class NonFiniteLossError(MixprecError, FloatingPointError):
    """The training loss became inf/NaN."""


@dataclass(frozen=True)
class BenchSettings:
    device: str
    batch_size: int
    steps: int = 10
    warmup: int = 2
    count_flops: bool = False
    # Profile one warm-up step for the share of time in matmuls/convolutions (the roofline view).
    profile: bool = True
    seed: int = 0
    # Keep timing past ``steps`` until this much timed time has passed (small models need
    # many steps for a stable median, big ones few), but never beyond ``max_steps``.
    min_time_s: float = 0.0
    max_steps: int = 200
    threads: int | None = None
    # Warm-up runs at least ``warmup`` steps and, when adaptive, more until steady (this many seconds
    # at most). Data-parallel ranks must run the same steps, so they use fixed counts.
    max_warmup_s: float = 30.0
    adaptive_warmup: bool = True
    # cuDNN autotuning on CUDA (the warm-up steps absorb its first-call cost); no effect on CPU.
    cudnn_benchmark: bool = True
    # Micro-batches of ``batch_size`` per optimizer step (gradient accumulation): one timed step is
    # that many forward/backward passes and one optimizer step, ``batch_size * accumulation_steps``
    # samples: how a larger effective batch runs where it does not fit as one micro-batch.
    accumulation_steps: int = 1

    def for_candidate(self, candidate: Any) -> BenchSettings:
        """The settings ``candidate`` runs under: its own micro-batch and accumulation where it
        names them (``tune --batch auto``), the same samples per optimizer step as the run's, so its
        step times pair with the baseline's; these settings otherwise."""
        if candidate.micro_batch is None:
            return self
        if candidate.micro_batch * candidate.accumulation_steps != self.batch_size * self.accumulation_steps:
            raise UsageError(
                f"{candidate.label} trains {candidate.micro_batch * candidate.accumulation_steps} samples "
                f"per optimizer step, the run {self.batch_size * self.accumulation_steps} (batch_size "
                f"{self.batch_size} x accumulation_steps {self.accumulation_steps}): their step times would "
                "not compare; give it micro_batch * accumulation_steps equal to the run's effective batch."
            )
        return replace(
            self, batch_size=candidate.micro_batch, accumulation_steps=candidate.accumulation_steps
        )


@dataclass(frozen=True)
class MemoryPoint:
    """The peak of one training step at ``batch_size`` samples.

    Attributes:
        peak_bytes: the tensor bytes alive at the step's peak (what a caching allocator is asked for).
        reserved_bytes: what the allocator held (CUDA's ``max_memory_reserved``); None on a CPU.
        parts: the peak by kind where known (parameters, gradients, optimizer state, activations...).
        method: how it was measured.
    """

    batch_size: int
    peak_bytes: int
    reserved_bytes: int | None = None
    parts: dict[str, int] = field(default_factory=dict)
    method: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryPoint:
        return cls(
            int(data["batch_size"]),
            int(data["peak_bytes"]),
            None if data.get("reserved_bytes") is None else int(data["reserved_bytes"]),
            {str(k): int(v) for k, v in (data.get("parts") or {}).items()},
            str(data.get("method", "")),
        )


@dataclass
class Measurement:
    step_times_s: list[float] = field(default_factory=list)  # timed steps only
    warmup_times_s: list[float] = field(default_factory=list)
    first_loss: float | None = None
    last_loss: float | None = None
    flops_per_step: int | None = None
    observed_dtype: str | None = None
    observed_layer: str | None = None
    peak_memory_bytes: int | None = None
    memory_method: str = ""
    stopped_early: bool = False
    skipped_steps: int = 0
    # torch.compile: graph breaks, graphs compiled, and graphs compiled after the first step
    graph_breaks: int | None = None
    graphs: int | None = None
    recompiles: int | None = None
    # share of one profiled step's operator time spent in matmuls and convolutions
    compute_share: float | None = None
    # share of it inside the optimizer's step (eager steps only): what a compiled step can fuse too
    optimizer_share: float | None = None
    # seconds spent building the compiled step before the first step ran (TensorFlow traces its
    # tf.function then); part of the first step's cost, kept out of the cold step pruning compares
    trace_s: float | None = None
    notes: list[str] = field(default_factory=list)  # what the row should say about how it ran


Emit = Callable[[dict[str, Any]], bool]  # returns False to stop the candidate (pruned)


def distinct_batches(settings: BenchSettings) -> int:
    """Distinct (micro-)batches a session cycles through: one step takes ``accumulation_steps``."""
    return min(_DISTINCT_BATCHES, settings.warmup + settings.steps) * settings.accumulation_steps


def steady(settings: BenchSettings, times: list[float], judged: list[float] | None = None) -> bool:
    """Whether warm-up steps that took ``times`` seconds are enough: at least ``settings.warmup``,
    then (adaptive warm-up) more until the last two of ``judged`` (default ``times``: a backend
    leaves out instrumented steps) agree within ``STEADY_TOLERANCE`` (oneDNN and XLA create their
    primitives and allocators settle over the first steps), at most ``MAX_WARMUP`` steps or
    ``settings.max_warmup_s`` seconds."""
    if len(times) < settings.warmup:
        return False
    if not settings.adaptive_warmup:
        return True
    judged = times if judged is None else judged
    agree = len(judged) >= 2 and abs(judged[-1] - judged[-2]) <= STEADY_TOLERANCE * min(judged[-2:])
    return agree or len(times) >= max(settings.warmup, MAX_WARMUP) or sum(times) >= settings.max_warmup_s


class Session(Protocol):
    """One candidate's training, stepped on demand (the torch and Keras sessions implement it).

    ``index`` is the number of steps run so far. :meth:`step` runs and times one step and returns
    its ``{"event": "step", "index", "seconds", "timed", "loss"}``; :meth:`warm_enough` says whether
    warm-up steps that took ``times`` seconds are enough; :meth:`warm_up` runs warm-up steps until
    they are (False when ``emit`` stopped it); :meth:`finish` returns the measurement.
    """

    index: int
    settings: BenchSettings
    result: Measurement

    def step(self, timed: bool) -> dict[str, Any]: ...

    def warm_enough(self, times: list[float]) -> bool: ...

    def warm_up(self, emit: Emit) -> bool: ...

    def finish(self) -> Measurement: ...


class SessionBase:
    """What the backends' sessions share: the warm-up loop and a step's bookkeeping."""

    index: int
    settings: BenchSettings
    result: Measurement

    def step(self, timed: bool) -> dict[str, Any]:
        raise NotImplementedError

    def warm_enough(self, times: list[float]) -> bool:
        return steady(self.settings, times)

    def warm_up(self, emit: Emit) -> bool:
        """Untimed steps until :meth:`warm_enough`; False when ``emit`` stopped it."""
        total = self.settings.warmup + self.settings.steps
        while True:
            event = self.step(timed=False)
            if not emit({**event, "total": total}):
                return False
            if self.warm_enough(self.result.warmup_times_s):
                return True

    def recorded(self, seconds: float, loss: float, timed: bool, *, skipped: bool = False) -> dict[str, Any]:
        """Step ``index``, which took ``seconds`` and ended at ``loss``, in :attr:`result`; its 'step'
        event. A non-finite loss raises, unless the step's update was skipped."""
        i, result = self.index, self.result
        if i == 0:
            result.first_loss = loss
        if not math.isfinite(loss) and not skipped:
            raise NonFiniteLossError(f"non-finite loss ({loss}) at step {i}")
        result.last_loss = loss
        (result.step_times_s if timed else result.warmup_times_s).append(seconds)
        self.index += 1
        return {"event": "step", "index": i, "seconds": seconds, "timed": timed, "loss": loss}
