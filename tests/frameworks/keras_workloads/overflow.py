"""A Keras workload with a planted fp16 overflow in one named layer: ``energy`` is a dense layer whose
pre-activations reach ~1e5 (beyond fp16's 65504) and are scaled back down by 1e-5 inside the same
layer. In float32 its output is ~1; under fp16 the matmul itself overflows to inf. Kept in float32,
the rest of the model trains fine in fp16."""

from __future__ import annotations

import numpy as np

from mixprec.frameworks.keras import KerasWorkload

LEARNING_RATE = 0.5  # SGD: the loss falls within a check's steps


def make_workload() -> KerasWorkload:
    import keras

    class ScaledDense(keras.layers.Layer):
        def __init__(self, units: int, scale: float, **kwargs):
            super().__init__(**kwargs)
            self.units, self.scale = units, scale

        def build(self, input_shape):
            self.kernel = self.add_weight(
                shape=(input_shape[-1], self.units),
                initializer=keras.initializers.RandomUniform(2000.0, 4000.0),
                trainable=False,  # a fixed projection: the planted problem is the forward overflow alone
            )

        def call(self, x):
            return keras.ops.matmul(x, self.kernel) * self.scale

    def make_model():
        inputs = keras.Input((32,))
        x = ScaledDense(16, 1e-5, name="energy")(inputs)
        x = keras.layers.Dense(32, activation="relu", name="hidden")(x)
        outputs = keras.layers.Dense(4, activation="softmax", name="head")(x)
        return keras.Model(inputs, outputs)

    def make_batch(batch_size: int):
        x = np.random.uniform(0.5, 1.0, (batch_size, 32)).astype(np.float32)
        labels = x[:, :4].argmax(axis=1)  # a task to learn (random labels left the check no power)
        return x, np.eye(4, dtype=np.float32)[labels]

    return KerasWorkload(
        make_model=make_model,
        make_batch=make_batch,
        loss=keras.losses.CategoricalCrossentropy(),
        make_optimizer=lambda: keras.optimizers.SGD(LEARNING_RATE),
        name="overflow",
        default_batch_size=16,
    )
