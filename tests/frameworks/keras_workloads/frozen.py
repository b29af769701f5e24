"""A Keras workload with nothing to train: every layer is frozen (``trainable=False``), as a user's
feature extractor is before its head is added. `check` must refuse it, as torch refuses a model
without a parameter that requires grad."""

from __future__ import annotations

import numpy as np

from mixprec.frameworks.keras import KerasWorkload


def make_workload() -> KerasWorkload:
    import keras

    def make_model():
        inputs = keras.Input((8,))
        x = keras.layers.Dense(8, activation="relu", name="hidden", trainable=False)(inputs)
        outputs = keras.layers.Dense(4, activation="softmax", name="head", trainable=False)(x)
        return keras.Model(inputs, outputs)

    def make_batch(batch_size: int):
        x = np.random.standard_normal((batch_size, 8)).astype(np.float32)
        return x, np.eye(4, dtype=np.float32)[np.random.randint(0, 4, batch_size)]

    return KerasWorkload(
        make_model=make_model,
        make_batch=make_batch,
        loss=keras.losses.CategoricalCrossentropy(),
        name="frozen",
        default_batch_size=8,
    )
