"""How a Keras model enters mixprec: a :class:`KerasWorkload`, built by a factory or the Keras zoo.

A Keras workload is a model factory (called under the candidate's dtype policy, since Keras fixes
a layer's dtype when it is constructed), a batch factory ``make_batch(batch_size) -> (x, y)``, the
loss and an optimizer factory. The zoo builds ``keras.applications`` models with ``weights=None``
on synthetic data, as the TensorFlow benchmark of SURF's 'Deep Learning on A100 GPUs' guide did:
nothing is downloaded. A spec (:class:`mixprec.WorkloadSpec`) rebuilds the same workload in a
candidate's own process.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from mixprec.errors import UsageError, did_you_mean
from mixprec.frameworks.keras import backend
from mixprec.workload.loader import call_factory
from mixprec.workload.workload import WorkloadSpec

KERAS_ZOO: tuple[str, ...] = ("resnet50", "vgg19", "densenet121", "mlp")
_APPLICATIONS = {"resnet50": "ResNet50", "vgg19": "VGG19", "densenet121": "DenseNet121"}
_NUM_CLASSES = 1000
_MIN_IMAGE_SIZE = 32  # VGG19 and DenseNet121 halve the image five times
_DEFAULT_IMAGE_SIZE = 224
_CNN_BATCH_SIZE = {"resnet50": 32, "vgg19": 16, "densenet121": 32}
_MLP_IN, _MLP_HIDDEN, _MLP_CLASSES = 64, 256, 10


def default_optimizer() -> Any:
    """SGD with momentum, as in SURF's A100 benchmark (and mixprec's torch workloads)."""
    return backend.keras().optimizers.SGD(learning_rate=0.01, momentum=0.9)


@dataclass
class KerasWorkload:
    """A Keras model and how to train it for one step.

    Attributes:
        make_model: builds the model; called with the candidate's global dtype policy set.
        make_batch: ``make_batch(batch_size) -> (x, y)`` numpy arrays or tensors; mixprec seeds
            numpy, Python and TensorFlow before each call, so draw from their global generators.
        loss: a Keras loss (``keras.losses.CategoricalCrossentropy()``) or ``loss(y_true, y_pred)``.
        make_optimizer: builds a Keras optimizer (default: SGD, lr 0.01, momentum 0.9).
        name / description: for tables and reports.
        default_batch_size: samples per step unless the command names another.
        spec: how another process rebuilds it (set by :func:`load_keras_workload`).
    """

    framework: ClassVar[str] = "tensorflow"

    make_model: Callable[[], Any]
    make_batch: Callable[[int], tuple[Any, Any]]
    loss: Any
    make_optimizer: Callable[[], Any] | None = None
    name: str = "keras"
    default_batch_size: int = 32
    spec: WorkloadSpec | None = field(default=None, repr=False)
    description: str = ""

    def __post_init__(self) -> None:
        for attr in ("make_model", "make_batch", "loss"):
            if not callable(getattr(self, attr)):
                raise UsageError(
                    f"KerasWorkload.{attr} must be callable, got {type(getattr(self, attr)).__name__}; "
                    "pass make_model=..., make_batch=..., loss=keras.losses.<Loss>()."
                )
        if self.make_optimizer is not None and not callable(self.make_optimizer):
            raise UsageError(
                f"KerasWorkload.make_optimizer must be callable or None, got {self.make_optimizer!r}."
            )

    def optimizer(self) -> Any:
        opt = (self.make_optimizer or default_optimizer)()
        if not isinstance(opt, backend.keras().optimizers.Optimizer):
            raise UsageError(
                f"make_optimizer of Keras workload {self.name!r} returned {type(opt).__name__}, expected a "
                "keras.optimizers.Optimizer (e.g. keras.optimizers.SGD(0.01, momentum=0.9))."
            )
        return opt

    def batch(self, batch_size: int, seed: int) -> tuple[Any, Any]:
        """``make_batch(batch_size)`` drawn under ``seed``; the caller's numpy and Python random
        states are put back afterwards."""
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            backend.keras().utils.set_random_seed(seed)
            batch = self.make_batch(batch_size)
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise UsageError(
                f"make_batch of Keras workload {self.name!r} returned {type(batch).__name__}; return (x, y)."
            )
        return batch[0], batch[1]


# ---------------------------------------------------------------------------------------- the zoo


def _cnn(name: str, image_size: int = _DEFAULT_IMAGE_SIZE) -> KerasWorkload:
    if not isinstance(image_size, int) or image_size < _MIN_IMAGE_SIZE:
        raise UsageError(
            f"image_size must be an integer >= {_MIN_IMAGE_SIZE} for {name}, got {image_size!r}."
        )

    def make_model() -> Any:
        applications = backend.keras().applications
        return getattr(applications, _APPLICATIONS[name])(
            weights=None, input_shape=(image_size, image_size, 3), classes=_NUM_CLASSES
        )

    def make_batch(batch_size: int) -> tuple[Any, Any]:
        images = np.random.standard_normal((batch_size, image_size, image_size, 3)).astype(np.float32)
        labels = np.random.randint(0, _NUM_CLASSES, batch_size)
        return images, np.eye(_NUM_CLASSES, dtype=np.float32)[labels]

    return KerasWorkload(
        make_model=make_model,
        make_batch=make_batch,
        loss=backend.keras().losses.CategoricalCrossentropy(),
        name=name,
        default_batch_size=_CNN_BATCH_SIZE[name],
        description=f"keras.applications.{_APPLICATIONS[name]}, {image_size}x{image_size}x3 images, "
        f"{_NUM_CLASSES} classes, categorical cross-entropy, synthetic data",
    )


def _mlp(hidden: int = _MLP_HIDDEN) -> KerasWorkload:
    """A tiny classifier for tests and smoke runs: fc1, fc2 and the softmax head."""

    def make_model() -> Any:
        keras = backend.keras()
        inputs = keras.Input((_MLP_IN,))
        x = keras.layers.Dense(hidden, activation="relu", name="fc1")(inputs)
        x = keras.layers.Dense(hidden, activation="relu", name="fc2")(x)
        outputs = keras.layers.Dense(_MLP_CLASSES, activation="softmax", name="head")(x)
        return keras.Model(inputs, outputs, name="mlp")

    def make_batch(batch_size: int) -> tuple[Any, Any]:
        x = np.random.standard_normal((batch_size, _MLP_IN)).astype(np.float32)
        labels = (x[:, :_MLP_CLASSES] * 3).argmax(axis=1)  # learnable: the largest of ten features
        return x, np.eye(_MLP_CLASSES, dtype=np.float32)[labels]

    return KerasWorkload(
        make_model=make_model,
        make_batch=make_batch,
        loss=backend.keras().losses.CategoricalCrossentropy(),
        name="mlp",
        default_batch_size=64,
        description=f"Keras MLP {_MLP_IN}-{hidden}-{hidden}-{_MLP_CLASSES}, synthetic data",
    )


def build_zoo(name: str, **sizes: Any) -> KerasWorkload:
    if name not in KERAS_ZOO:
        raise UsageError(
            f"Unknown Keras zoo model {name!r}; valid: {', '.join(KERAS_ZOO)}.{did_you_mean(name, KERAS_ZOO)}"
        )
    allowed = {"mlp": ("hidden",)}.get(name, ("image_size",))
    bad = [k for k in sizes if k not in allowed]
    if bad:
        raise UsageError(
            f"Keras zoo model {name!r} takes {', '.join(allowed)}, not {', '.join(bad)}; drop "
            f"{', '.join('--' + b.replace('_', '-') for b in bad)}."
        )
    workload = _mlp(**sizes) if name == "mlp" else _cnn(name, **sizes)
    workload.spec = WorkloadSpec("zoo", name, tuple(sorted(sizes.items())))
    return workload


# ----------------------------------------------------------------------------------------- loader


def load_keras_workload(target: str, **sizes: Any) -> KerasWorkload:
    """The Keras workload ``target`` names: a Keras zoo model (``resnet50``, ``vgg19``,
    ``densenet121``, ``mlp``) or a factory ``path/to/file.py:function`` /
    ``package.module:function`` returning a :class:`KerasWorkload`."""
    backend.keras()  # a clear error before anything else when TensorFlow is missing
    if not isinstance(target, str) or not target.strip():
        raise UsageError(f"Keras workload target {target!r} is empty; pass a zoo name or 'file.py:function'.")
    target = target.strip()
    if target in KERAS_ZOO:
        return build_zoo(target, **sizes)
    if ":" not in target:
        raise UsageError(
            f"Keras workload target {target!r} is neither a Keras zoo model ({', '.join(KERAS_ZOO)}) nor "
            f"'file.py:function' / 'module:function'.{did_you_mean(target, KERAS_ZOO)}"
        )
    return call_factory(
        target,
        sizes,
        KerasWorkload,
        "a mixprec.keras.KerasWorkload(make_model=..., make_batch=..., loss=...)",
    )


def keras_workload_from_spec(spec: dict[str, Any]) -> KerasWorkload:
    """Rebuild a Keras workload from its spec's dict (in a candidate's process)."""
    sizes = dict(spec.get("sizes") or {})
    if spec["kind"] == "zoo":
        return build_zoo(spec["target"], **sizes)
    return load_keras_workload(spec["target"], **sizes)


def workload_label(workload: KerasWorkload) -> str:
    sizes = dict(workload.spec.sizes) if workload.spec else {}
    inner = ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))
    return f"keras:{workload.name}" + (f"({inner})" if inner else "")
