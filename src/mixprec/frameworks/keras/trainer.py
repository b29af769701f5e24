"""One candidate's Keras model, optimizer and compiled train step.

The train step is a ``tf.function`` (``jit_compile=True`` for the "xla" candidates): forward under
a ``GradientTape``, the loss in float32, scaled by the ``LossScaleOptimizer`` for fp16 policies,
gradients, and ``optimizer.apply`` (which unscales, skips non-finite steps and adapts the scale).
It is traced once when the trainer is built (timed as ``trace_s``; XLA candidates also run one
step there, which compiles, and start again from the initial state), so the first step measures
the first execution, comparable across candidates. Every Dense/Conv layer is watched while the step
is traced: the first one records the dtype it really computed in (the honesty probe).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from fnmatch import fnmatch
from typing import Any

import numpy as np

from mixprec.frameworks.keras import backend
from mixprec.frameworks.keras.policy import KerasPolicy, compute_layers, output_layers
from mixprec.frameworks.keras.workload import KerasWorkload
from mixprec.frameworks.session import HonestyError
from mixprec.policy import Candidate

SEED = 0


def make_batches(workload: KerasWorkload, batch_size: int, device: str, seed: int, n: int) -> list[tuple]:
    """The same ``n`` batches for every candidate, as float32 tensors on ``device``."""
    tf = backend.tf()
    batches = []
    with tf.device(backend.device_name(device)):
        for i in range(n):
            x, y = workload.batch(batch_size, seed + i)
            batches.append((tf.constant(x), tf.constant(y)))
    return batches


class _DtypeProbe:
    """Records the output dtype of the first watched layer that runs (at trace time)."""

    def __init__(self, layers: Sequence[Any]) -> None:
        self.name: str | None = None
        self.dtype: str | None = None
        self._layers = list(layers)
        for layer in self._layers:
            original = layer.call

            def call(*args: Any, _layer: Any = layer, _original: Any = original, **kwargs: Any) -> Any:
                out = _original(*args, **kwargs)
                if self.name is None and hasattr(out, "dtype"):
                    self.name, self.dtype = _layer.name, str(getattr(out.dtype, "name", out.dtype))
                return out

            object.__setattr__(layer, "call", call)

    def remove(self) -> None:
        for layer in self._layers:
            layer.__dict__.pop("call", None)
        self._layers.clear()


class KerasTrainer:
    """A candidate's model and train step; :meth:`step` trains on one batch."""

    def __init__(
        self,
        workload: KerasWorkload,
        candidate: Candidate,
        device: str,
        example: tuple[Any, Any],
        reference_weights: Sequence[Any] | None = None,
    ) -> None:
        tf = self._tf = backend.tf()
        self.workload, self.candidate = workload, candidate
        self.policy = KerasPolicy(candidate)
        self.device = backend.device_name(device)
        with tf.device(self.device):
            self.model = self.policy.build_model(workload.make_model, SEED, reference_weights)
            self.initial_weights = self.model.get_weights()
            self.optimizer = self.policy.optimizer(workload.optimizer())
            self.variables = list(self.model.trainable_variables)
            self.optimizer.build(self.variables)
            self._initial_optimizer = [v.numpy() for v in self.optimizer.variables]
        # fp32 islands and the float32 output layer compute in float32 on purpose: not probed
        skip = {layer.name for layer in output_layers(self.model)}
        skip |= {
            layer.name
            for layer in self.model._flatten_layers(include_self=False)
            if any(fnmatch(layer.name, p) for p in candidate.keep_fp32)
        }
        probe = _DtypeProbe(compute_layers(self.model, tuple(skip)))
        jit = candidate.compile == "xla"
        # autograph=False, as Keras' own model.fit step (do_not_convert): the step has no
        # tensor-dependent Python control flow, and AutoGraph would re-read this file's source when
        # each candidate process traces it: a file edited during a sweep made it convert other lines.
        self._step = tf.function(self._train_step, jit_compile=jit, autograph=False)
        self._probe_fn = tf.function(self._grads, jit_compile=jit, autograph=False)
        specs = [tf.TensorSpec.from_tensor(tf.convert_to_tensor(t)) for t in example]
        start = time.perf_counter()
        try:
            with self.policy.scope(), tf.device(self.device):
                self._step.get_concrete_function(*specs)
        finally:
            probe.remove()
        self.observed_layer, self.observed_dtype = probe.name, probe.dtype
        self._check_honesty()
        if jit:
            # XLA compiles on the first execution, not when traced: one step on the example batch,
            # then the initial weights and optimizer state back, so compilation is timed with the
            # trace (a cold first step of tens of seconds would be pruned as a hopeless candidate)
            with self.policy.scope(), tf.device(self.device):
                self._step(*example)
            self.reset()
        self.trace_s = time.perf_counter() - start

    def _check_honesty(self) -> None:
        expected = self.policy.compute_dtype
        if self.observed_layer is not None and self.observed_dtype != expected:
            raise HonestyError(
                f"labelled {self.candidate.label} but the first Dense/Conv layer {self.observed_layer!r} "
                f"computed in {self.observed_dtype} instead of {expected}: the dtype policy did not take "
                "effect"
            )

    # --------------------------------------------------------------------------- compiled functions
    def _loss(self, x: Any, y: Any) -> tuple[Any, Any]:
        tf = self._tf
        out = self.model(x, training=True)
        return tf.cast(self.workload.loss(y, out), tf.float32), out

    def _train_step(self, x: Any, y: Any) -> tuple[Any, Any]:
        tf = self._tf
        with tf.GradientTape() as tape:
            loss, _ = self._loss(x, y)
            scaled = self.optimizer.scale_loss(loss) if self.policy.loss_scaling else loss
        grads = tape.gradient(scaled, self.variables)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None])
        self.optimizer.apply(grads, self.variables)
        return loss, finite

    def _grads(self, x: Any, y: Any, scale: Any) -> tuple[Any, Any, list[Any]]:
        tf = self._tf
        with tf.GradientTape() as tape:
            loss, out = self._loss(x, y)
            scaled = loss * tf.cast(scale, loss.dtype)
        grads = tape.gradient(scaled, self.variables)
        return loss, out, grads

    # --------------------------------------------------------------------------- use
    def step(self, batch: tuple[Any, Any]) -> tuple[float, bool]:
        """One training step: (loss, whether the optimizer applied it); waits for the result."""
        tf = backend.tf()
        with self.policy.scope(), tf.device(self.device):
            loss, finite = self._step(*batch)
        return float(loss), bool(finite)

    def first_step_probe(
        self, batch: tuple[Any, Any]
    ) -> tuple[np.ndarray, dict[str, np.ndarray], float | None]:
        """Output and unscaled gradients of one forward/backward from the current weights. Loss-scaled
        policies start at the optimizer's initial scale and halve it until the gradients are finite,
        as the loss-scale optimizer would over skipped steps; returns that scale too."""
        tf = backend.tf()
        scale = float(self.optimizer.initial_scale) if self.policy.loss_scaling else 1.0
        with self.policy.scope(), tf.device(self.device):
            for _ in range(40):
                _, out, grads = self._probe_fn(*batch, tf.constant(scale, tf.float32))
                finite = all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads if g is not None)
                if finite or not self.policy.loss_scaling:
                    break
                scale *= 0.5
        names = variable_names(self.variables)
        grad_arrays = {
            name: g.numpy().astype(np.float32) / scale
            for name, g in zip(names, grads, strict=True)
            if g is not None
        }
        first = tf.nest.flatten(out)[0]
        return first.numpy().astype(np.float32), grad_arrays, scale if self.policy.loss_scaling else None

    @property
    def scale(self) -> float | None:
        """The loss-scale optimizer's current scale, None without loss scaling."""
        return float(self.optimizer.dynamic_scale.numpy()) if self.policy.loss_scaling else None

    def reset(self, weights: Sequence[Any] | None = None, scale: float | None = None) -> None:
        """Start again from ``weights`` (default: the initial ones) with a fresh optimizer state
        (and the loss scale at ``scale``): a second run without tracing the step again."""
        self.model.set_weights(list(weights if weights is not None else self.initial_weights))
        for var, value in zip(self.optimizer.variables, self._initial_optimizer, strict=True):
            var.assign(value)
        if scale is not None and self.policy.loss_scaling:
            self.optimizer.dynamic_scale.assign(scale)


def reference_weights(
    workload: KerasWorkload, candidate: Candidate, device: str, *, always: bool = False
) -> list[Any] | None:
    """The fp32 model's initial weights for a candidate with half-precision variables (*-true:
    their initialisers draw other values), None where seeded building gives the same weights
    (unless ``always``)."""
    if candidate.spec.param_dtype is None and not always:
        return None
    tf = backend.tf()
    fp32 = KerasPolicy(Candidate("fp32", framework="tensorflow"))
    with tf.device(backend.device_name(device)):
        return fp32.build_model(workload.make_model, SEED).get_weights()


def variable_names(variables: Sequence[Any]) -> list[str]:
    """Unique, stable names of trainable variables: their Keras paths ('fc1/kernel')."""
    return [getattr(v, "path", None) or v.name for v in variables]
