"""The Keras 3 on TensorFlow backend (:class:`~mixprec.frameworks.keras.framework.KerasFramework`):
Keras workloads measured, checked, tuned and exported by mixprec's one pipeline.

Importing this package imports no TensorFlow; each function imports it on first use and raises
:class:`mixprec.UnsupportedError` with the install hint when it is missing.
"""

from mixprec.frameworks.keras.backend import INSTALL_HINT, missing
from mixprec.frameworks.keras.workload import KERAS_ZOO, KerasWorkload, load_keras_workload

__all__ = ["INSTALL_HINT", "KERAS_ZOO", "KerasWorkload", "load_keras_workload", "missing"]
