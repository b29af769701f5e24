"""``mixprec.keras``: what a Keras user imports. The backend itself lives in
:mod:`mixprec.frameworks.keras`; ``mixprec.bench``, ``check`` and ``tune`` take a
:class:`KerasWorkload` as they take a :class:`mixprec.Workload`.

Importing this module imports no TensorFlow.
"""

from mixprec.frameworks.keras import INSTALL_HINT, KERAS_ZOO, KerasWorkload, load_keras_workload, missing

__all__ = ["INSTALL_HINT", "KERAS_ZOO", "KerasWorkload", "load_keras_workload", "missing"]
