"""Tuning: measure, gate by numerics, decide, and cache the decision.

:func:`tune` runs the search (its settings a :class:`TuneConfig`), :func:`decide` is the pure
decision over measurements, and :func:`autotune` returns the recommended candidate whole, as a
:class:`Tuned` that applies it, tuned once per model and machine.
"""

from mixprec.tuning.cache import autotune, autotune_key
from mixprec.tuning.config import TuneConfig
from mixprec.tuning.decide import Ranked, Recommendation, decide
from mixprec.tuning.result import TuneResult
from mixprec.tuning.run import tune
from mixprec.tuning.tuned import Tuned

__all__ = [
    "Ranked",
    "Recommendation",
    "TuneConfig",
    "TuneResult",
    "Tuned",
    "autotune",
    "autotune_key",
    "decide",
    "tune",
]
