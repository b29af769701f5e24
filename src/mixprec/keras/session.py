"""A Keras candidate's training session, with the interface of :class:`mixprec.measure.runner.TrainingSession`
(``warm_up``, ``step``, ``warm_enough``, ``finish``), so the paired sweep, its child processes and
its pruning drive TensorFlow candidates exactly as torch ones.
"""

from __future__ import annotations

import math
import time
from typing import Any

from mixprec.keras import backend
from mixprec.keras.trainer import KerasTrainer, make_batches, reference_weights
from mixprec.keras.workload import KerasWorkload, keras_workload_from_spec
from mixprec.measure.runner import (
    MAX_WARMUP,
    STEADY_TOLERANCE,
    BenchSettings,
    Emit,
    Measurement,
    NonFiniteLossError,
    distinct_batches,
)
from mixprec.policy import Candidate


class KerasSession:
    """One candidate's Keras model stepped on demand; each step timed until its loss is on the host."""

    def __init__(
        self,
        workload: KerasWorkload,
        candidate: Candidate,
        settings: BenchSettings,
        batches: list | None = None,
    ) -> None:
        backend.set_threads(settings.threads)
        self.candidate, self.settings = candidate, settings
        self.batches = batches or make_batches(
            workload, settings.batch_size, settings.seed, distinct_batches(settings), settings.device
        )
        self.trainer = KerasTrainer(
            workload,
            candidate,
            settings.device,
            self.batches[0],
            reference_weights(workload, candidate, settings.device),
        )
        self.result = Measurement(
            trace_s=self.trainer.trace_s,
            observed_dtype=self.trainer.observed_dtype,
            observed_layer=self.trainer.observed_layer,
        )
        self.index = 0

    def step(self, timed: bool) -> dict[str, Any]:
        i = self.index
        start = time.perf_counter()
        loss, applied = self.trainer.step(self.batches[i % len(self.batches)])
        seconds = time.perf_counter() - start
        if i == 0:
            self.result.first_loss = loss
        if not math.isfinite(loss):
            raise NonFiniteLossError(f"non-finite loss ({loss}) at step {i}")
        self.result.skipped_steps += int(not applied)
        self.result.last_loss = loss
        (self.result.step_times_s if timed else self.result.warmup_times_s).append(seconds)
        self.index += 1
        return {"event": "step", "index": i, "seconds": seconds, "timed": timed, "loss": loss}

    def warm_enough(self, times: list[float]) -> bool:
        """At least ``settings.warmup`` steps, then more until two in a row agree within
        ``STEADY_TOLERANCE`` (oneDNN and XLA settle over the first executions), within the caps."""
        settings = self.settings
        if len(times) < settings.warmup:
            return False
        if not settings.adaptive_warmup:
            return True
        steady = len(times) >= 2 and abs(times[-1] - times[-2]) <= STEADY_TOLERANCE * min(times[-2:])
        return steady or len(times) >= max(settings.warmup, MAX_WARMUP) or sum(times) >= settings.max_warmup_s

    def warm_up(self, emit: Emit) -> bool:
        while True:
            event = self.step(timed=False)
            if not emit({**event, "total": self.settings.warmup + self.settings.steps}):
                return False
            if self.warm_enough(self.result.warmup_times_s):
                return True

    def finish(self) -> Measurement:
        if self.trainer.device.startswith("/GPU"):
            info = backend.tf().config.experimental.get_memory_info(self.trainer.device.strip("/"))
            self.result.peak_memory_bytes = int(info["peak"])
            self.result.memory_method = "tf.config.experimental.get_memory_info peak"
        return self.result


def build_keras_session(spec: dict[str, Any], candidate: Candidate, settings: BenchSettings) -> KerasSession:
    """A candidate process's session (:data:`mixprec.measure.isolate.SessionBuilder`): the threads
    set before TensorFlow's runtime starts, the workload rebuilt from its spec."""
    backend.set_threads(settings.threads)
    return KerasSession(keras_workload_from_spec(spec), candidate, settings)
