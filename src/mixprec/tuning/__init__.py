"""Tuning: measure, gate by numerics, decide, and cache the decision.

:func:`tune` runs the search, :func:`decide` is the pure decision over measurements, and
:func:`autotune` returns the recommended :class:`~mixprec.Policy`, tuned once per model and
machine.
"""

from mixprec.tuning.cache import autotune, autotune_key
from mixprec.tuning.decide import Ranked, Recommendation, decide
from mixprec.tuning.result import TuneResult
from mixprec.tuning.run import tune

__all__ = [
    "Ranked",
    "Recommendation",
    "TuneResult",
    "autotune",
    "autotune_key",
    "decide",
    "tune",
]
