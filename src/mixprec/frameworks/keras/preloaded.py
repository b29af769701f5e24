"""Imported once by the fork server of Keras candidate processes (``isolate.preload``): TensorFlow
and Keras through :func:`mixprec.frameworks.keras.backend.keras`, so the import is as quiet there as in the
parent (a bare ``import tensorflow`` prints absl/oneDNN start-up lines in every sweep)."""

from mixprec.frameworks.keras import backend

backend.keras()
