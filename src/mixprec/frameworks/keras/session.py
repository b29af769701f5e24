"""A Keras candidate's training session, with the :class:`~mixprec.frameworks.session.Session`
interface (``warm_up``, ``step``, ``warm_enough``, ``finish``), so the paired sweep, its child
processes and its pruning drive TensorFlow candidates exactly as torch ones.
"""

from __future__ import annotations

import time
from typing import Any

from mixprec.frameworks.keras import backend
from mixprec.frameworks.keras.trainer import KerasTrainer, make_batches, reference_weights
from mixprec.frameworks.keras.workload import KerasWorkload, keras_workload_from_spec
from mixprec.frameworks.session import BenchSettings, Measurement, SessionBase, distinct_batches
from mixprec.policy import Candidate


class KerasSession(SessionBase):
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
        start = time.perf_counter()
        loss, applied = self.trainer.step(self.batches[self.index % len(self.batches)])
        seconds = time.perf_counter() - start
        event = self.recorded(seconds, loss, timed)
        self.result.skipped_steps += int(not applied)
        return event

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
