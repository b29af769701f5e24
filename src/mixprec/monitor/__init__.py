"""The precision autopilot: :class:`Monitor` watches a long run, tells a precision failure from a
bad batch and (``rescue=True``) rescues it, configured by one :class:`MonitorConfig`; what it looks
for is one :class:`~mixprec.monitor.detectors.Detector` per kind of trouble
(:mod:`mixprec.monitor.detectors`). Adapters: :mod:`mixprec.monitor.lightning` (a Lightning
``Callback``), :mod:`mixprec.monitor.hf` (a ``TrainerCallback``), :mod:`mixprec.monitor.accelerate`."""

from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.core import Monitor, MonitorStop, PoisonedCheckpointError
from mixprec.monitor.findings import KINDS, Finding, MonitorFinding

__all__ = [
    "KINDS",
    "Finding",
    "Monitor",
    "MonitorConfig",
    "MonitorFinding",
    "MonitorStop",
    "PoisonedCheckpointError",
]
