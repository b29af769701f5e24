"""TensorFlow/Keras 3: Keras workloads measured, checked, tuned and exported by the same machinery
as torch ones (paired child processes, the same rows, verdicts, decision and report).

Importing this package imports no TensorFlow; each function imports it on first use and raises
:class:`mixprec.UnsupportedError` with the install hint when it is missing.
"""

from mixprec.keras.backend import INSTALL_HINT, missing
from mixprec.keras.workload import KERAS_ZOO, KerasWorkload, load_keras_workload

__all__ = ["INSTALL_HINT", "KERAS_ZOO", "KerasWorkload", "load_keras_workload", "missing"]
