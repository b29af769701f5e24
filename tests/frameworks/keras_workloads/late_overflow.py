"""The Keras twin of examples/late_overflow.py: a dense head on frozen sigmoid features, trained by
Adam toward targets around 1e6 with an L1 loss; its output grows by about 450 a step and outgrows
fp16 (65504) after ~140 steps, far past a check's 8."""

from __future__ import annotations

import numpy as np

from mixprec.frameworks.keras import KerasWorkload


def make_workload() -> KerasWorkload:
    import keras

    teacher = np.random.default_rng(1).standard_normal(16).astype(np.float32)

    def make_model():
        inputs = keras.Input((16,))
        features = keras.layers.Dense(64, activation="sigmoid", name="features", trainable=False)(inputs)
        scaled = keras.layers.Rescaling(40.0, name="scale")(features)
        outputs = keras.layers.Dense(1, name="head")(scaled)
        return keras.Model(inputs, outputs)

    def make_batch(batch_size: int):
        x = np.random.standard_normal((batch_size, 16)).astype(np.float32)
        y = (1e6 + 1e5 * np.tanh(x @ teacher)).astype(np.float32)[:, None]
        return x, y

    return KerasWorkload(
        make_model=make_model,
        make_batch=make_batch,
        loss=keras.losses.MeanAbsoluteError(),
        make_optimizer=lambda: keras.optimizers.Adam(0.35),
        name="late_overflow",
        default_batch_size=64,
    )
