"""A Keras candidate's training session, with the :class:`~mixprec.frameworks.session.Session`
interface (``warm_up``, ``step``, ``warm_enough``, ``finish``), so the paired sweep, its child
processes and its pruning drive TensorFlow candidates exactly as torch ones.
"""

from __future__ import annotations

import math
import time
from typing import Any

from mixprec.frameworks.keras import backend
from mixprec.frameworks.keras.trainer import KerasTrainer, make_batches, reference_weights
from mixprec.frameworks.keras.workload import KerasWorkload, keras_workload_from_spec
from mixprec.frameworks.session import (
    BenchSettings,
    Emit,
    Measurement,
    NonFiniteLossError,
    distinct_batches,
    run_warm_up,
    steady,
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
            workload, settings.batch_size, settings.device, settings.seed, distinct_batches(settings)
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
        return steady(self.settings, times)

    def warm_up(self, emit: Emit) -> bool:
        return run_warm_up(self, emit)

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
