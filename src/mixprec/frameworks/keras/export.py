"""The recommended policy as Keras code: ``set_global_policy``, the float32 output (and keep_fp32)
layers, ``LossScaleOptimizer``, the TF32 call, XLA, and a ``tf.distribute.MirroredStrategy`` note."""

from __future__ import annotations

from mixprec.errors import UnsupportedError
from mixprec.policy import Candidate


def keras_code(candidate: Candidate) -> str:
    """Ready-to-paste Keras 3 code that trains with ``candidate``'s policy (pure text)."""
    spec = candidate.spec
    if spec.keras is None:
        raise UnsupportedError(f"{candidate.policy} has no Keras dtype policy; nothing to export for Keras.")
    tf32 = candidate.policy == "tf32"
    low = spec.keras not in ("float32",)
    lines = [
        f"# mixprec recommendation for Keras 3 on TensorFlow: {candidate.label}",
        "# What runs: " + spec.description + ".",
        "import keras",
        "import tensorflow as tf",
        "",
        "# TensorFlow ignores NVIDIA_TF32_OVERRIDE: set TF32 explicitly (it is on by default on Ampere+).",
        f"tf.config.experimental.enable_tensor_float_32_execution({tf32})",
        f'keras.mixed_precision.set_global_policy("{spec.keras}")  # before building the model',
        "",
        "model = build_model()  # yours: layers take the global policy when they are constructed",
    ]
    if low:
        lines += [
            "# The output layer in float32 (softmax and loss), as the Keras mixed-precision guide requires:",
            '# build it with dtype="float32", e.g. keras.layers.Dense(classes, activation="softmax", '
            'dtype="float32"),',
            "# or, for a built functional model (as mixprec measured):",
            "for tensor in model.outputs:",
            '    tensor._keras_history[0].dtype_policy = "float32"',
        ]
    if candidate.keep_fp32:
        names = ", ".join(repr(n) for n in candidate.keep_fp32)
        lines += [
            f'# fp32 islands: construct these layers with dtype="float32" in build_model(): {names}',
            "# (layer names, glob patterns as mixprec matched them)",
        ]
    optimizer = "keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)  # yours"
    lines.append("")
    if spec.loss_scaling:
        lines += [
            "# fp16: dynamic loss scaling (model.compile wraps the optimizer itself under mixed_float16;",
            "# wrap it explicitly for a custom training loop: optimizer.scale_loss(loss), then apply()).",
            f"optimizer = keras.optimizers.LossScaleOptimizer({optimizer})",
        ]
    else:
        lines.append(f"optimizer = {optimizer}")
    jit = "True" if candidate.compile == "xla" else "False"
    lines += [
        f"model.compile(optimizer=optimizer, loss=keras.losses.CategoricalCrossentropy(), jit_compile={jit})",
        "model.fit(dataset, epochs=...)",
        "",
        "# Several GPUs: build and compile inside `with tf.distribute.MirroredStrategy().scope():`, after",
        "# set_global_policy; every replica then runs the same policy (LossScaleOptimizer is replica-aware).",
    ]
    return "\n".join(lines) + "\n"
