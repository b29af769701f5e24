"""The precision autopilot: :class:`Monitor` watches a long run, tells a precision failure from a
bad batch and (``rescue=True``) rescues it. Adapters: :mod:`mixprec.monitor.lightning`
(a Lightning ``Callback``), :mod:`mixprec.monitor.hf` (a ``TrainerCallback``),
:mod:`mixprec.monitor.accelerate`."""

from mixprec.monitor.core import Monitor, MonitorStop, PoisonedCheckpointError
from mixprec.monitor.findings import KINDS, Finding

__all__ = ["KINDS", "Finding", "Monitor", "MonitorStop", "PoisonedCheckpointError"]
