"""The monitor's detectors, one class per kind of trouble, each in its own module behind one small
interface (:mod:`mixprec.monitor.detectors.base`), composed from a
:class:`~mixprec.monitor.config.MonitorConfig` by :func:`detectors_for`."""

from __future__ import annotations

from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.detectors.bad_batch import BadBatch
from mixprec.monitor.detectors.base import (
    NONFINITE,
    SCALER_SKIPPED_NONFINITE,
    SKIP,
    Detector,
    Run,
    SampleView,
    StepView,
    UpdateView,
)
from mixprec.monitor.detectors.drift import Drift
from mixprec.monitor.detectors.overflow import Overflow
from mixprec.monitor.detectors.poisoned import PoisonedWeights
from mixprec.monitor.detectors.ranges import PredictedRange
from mixprec.monitor.detectors.spike import Spike
from mixprec.monitor.detectors.stall import Stall


def detectors_for(config: MonitorConfig) -> list[Detector]:
    """The detectors a run with ``config`` uses, in the order they are asked: what blames the
    weights, then the batch, comes before what blames the precision (a step or sample they
    explain is not the precision's); the trends after the faults; spikes (``spikes``: the only one
    asked before the update lands); the fp32 shadow step (drift) only where ``shadow_every`` asks
    for it."""
    detectors: list[Detector] = [
        PoisonedWeights(config),
        BadBatch(config),
        Overflow(config),
        PredictedRange(config),
        Stall(config),
    ]
    if config.spikes:
        detectors.append(Spike(config))
    if config.shadow_every:
        detectors.append(Drift(config))
    return detectors


__all__ = [
    "NONFINITE",
    "SCALER_SKIPPED_NONFINITE",
    "SKIP",
    "BadBatch",
    "Detector",
    "Drift",
    "Overflow",
    "PoisonedWeights",
    "PredictedRange",
    "Run",
    "SampleView",
    "Spike",
    "Stall",
    "StepView",
    "UpdateView",
    "detectors_for",
]
