"""A precision policy in Keras terms: the global dtype policy, fp32 islands, the float32 output
layer, loss scaling and the TF32 switch, applied and put back like the torch policy's
``precision_scope``.

- ``fp32``: ``float32`` with TF32 off (``tf.config.experimental.enable_tensor_float_32_execution(False)``;
  TensorFlow enables TF32 by default on Ampere and newer, and ignores ``NVIDIA_TF32_OVERRIDE``).
- ``tf32``: ``float32`` with TF32 on (GPU only).
- ``bf16-mixed`` / ``fp16-mixed``: ``mixed_bfloat16`` / ``mixed_float16`` (fp32 variables), the latter
  with ``keras.optimizers.LossScaleOptimizer`` (dynamic scale).
- ``bf16-true`` / ``fp16-true``: the ``bfloat16`` / ``float16`` dtype policies (half variables, no
  master weights); fp16-true with the loss-scale optimizer too, as torch's fp16-true scales.

The model's output layer always computes in float32 under a lower-precision policy, as the Keras
mixed-precision guide requires (softmax and loss in float32). ``keep_fp32`` globs name more
layers (by ``layer.name``) that are built with ``dtype="float32"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

from mixprec.errors import UnsupportedError, UsageError
from mixprec.frameworks.keras import backend
from mixprec.hardware.device import DeviceInfo
from mixprec.policy import Candidate, Support

# Keras layers whose output dtype shows which precision really ran (they autocast their inputs).
COMPUTE_LAYERS = ("Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2D", "SeparableConv2D")


def keras_support(candidate: Candidate, info: DeviceInfo) -> Support:
    """Whether TensorFlow runs ``candidate``'s policy on the device, natively, and why."""
    spec = candidate.spec
    if spec.keras is None:
        return Support(
            False, f"{spec.name} has no Keras dtype policy (TensorFlow has no such math mode)", "fp32", False
        )
    if spec.name == "tf32":
        if not info.tf32:
            return Support(False, "TF32 needs an NVIDIA GPU with compute capability >= 8.0", "fp32", False)
        return Support(
            True, "TF32 tensor cores (TensorFlow ignores NVIDIA_TF32_OVERRIDE; mixprec sets TF32 itself)"
        )
    if info.type == "cuda":
        if spec.compute_format == "bf16" and not info.native_bf16:
            return Support(True, "bf16 needs compute capability >= 8.0: emulated here", "fp16-mixed", False)
        return Support(True, f"{spec.keras} on the GPU")
    if spec.compute_format == "bf16":
        if info.native_bf16:
            return Support(True, "oneDNN bf16 kernels (AVX512-BF16/AMX) on this CPU")
        return Support(True, "no native bf16 on this CPU: expect it to be slower than fp32", "fp32", False)
    if spec.compute_format == "fp16":
        return Support(
            True,
            "TensorFlow has no fast fp16 convolution kernels on CPU (its Eigen fallback is far slower than "
            "fp32): runs, but is pruned as hopeless",
            "bf16-mixed" if info.native_bf16 else "fp32",
            False,
        )
    return Support(True, "float32 works everywhere")


@dataclass(frozen=True)
class KerasPolicy:
    """What ``candidate`` means for a Keras model (see the module doc)."""

    candidate: Candidate

    def __post_init__(self) -> None:
        if self.candidate.framework != "tensorflow":
            raise UsageError(
                f"KerasPolicy takes a TensorFlow candidate, got framework={self.candidate.framework!r}; "
                "use Candidate(policy, framework='tensorflow')."
            )
        if self.candidate.spec.keras is None:
            raise UnsupportedError(
                f"{self.candidate.policy} has no Keras dtype policy; valid for TensorFlow: fp32, tf32, "
                "bf16-mixed, fp16-mixed, bf16-true, fp16-true."
            )

    @property
    def dtype_policy(self) -> str:
        return str(self.candidate.spec.keras)

    @property
    def compute_dtype(self) -> str:
        """The dtype Dense/Conv layers compute in: 'float32', 'bfloat16' or 'float16'."""
        return {"mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}.get(
            self.dtype_policy, self.dtype_policy
        )

    @property
    def loss_scaling(self) -> bool:
        return self.candidate.spec.loss_scaling

    @property
    def tf32(self) -> bool:
        return self.candidate.policy == "tf32"

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The global dtype policy and the TF32 switch of this policy; both put back on exit."""
        tf, keras = backend.tf(), backend.keras()
        before_policy = keras.mixed_precision.global_policy()
        before_tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
        keras.mixed_precision.set_global_policy(self.dtype_policy)
        tf.config.experimental.enable_tensor_float_32_execution(self.tf32)
        try:
            yield
        finally:
            keras.mixed_precision.set_global_policy(before_policy)
            tf.config.experimental.enable_tensor_float_32_execution(before_tf32)

    def build_model(self, make_model: Any, seed: int, reference_weights: Sequence[Any] | None = None) -> Any:
        """``make_model()`` under this policy: a fresh Keras session (same layer names every time),
        seeded initial weights (``reference_weights`` copied in when given: half-precision
        variables draw different initial values), keep_fp32 layers and the output layer in float32."""
        keras = backend.keras()
        keras.backend.clear_session()
        keras.utils.set_random_seed(seed)
        patterns = self.candidate.keep_fp32
        with self.scope(), _float32_layers(keras, patterns) as islands:
            model = make_model()
        if not isinstance(model, keras.Model):
            raise UsageError(f"make_model returned {type(model).__name__}, expected a keras.Model.")
        unmatched = [p for p in patterns if not any(fnmatch(name, p) for name in islands)]
        if unmatched:
            names = [layer.name for layer in model._flatten_layers(include_self=False)]
            raise UsageError(
                f"keep_fp32 pattern(s) {', '.join(map(repr, unmatched))} match no layer of the Keras model; "
                f"its layers: {', '.join(names[:40])}{' ...' if len(names) > 40 else ''}."
            )
        if self.compute_dtype != "float32":
            for layer in output_layers(model):
                layer.dtype_policy = "float32"  # softmax and loss in float32 (Keras mixed-precision guide)
        if reference_weights is not None:
            model.set_weights(list(reference_weights))
        return model

    def optimizer(self, inner: Any) -> Any:
        """``inner`` wrapped in ``LossScaleOptimizer`` (dynamic scale) for fp16 policies."""
        if not self.loss_scaling:
            return inner
        return backend.keras().optimizers.LossScaleOptimizer(inner)


@contextlib.contextmanager
def _float32_layers(keras: Any, patterns: Sequence[str]) -> Iterator[list[str]]:
    """While active, every Keras layer whose name matches a pattern is constructed with the float32
    dtype policy (before it builds its variables): the island is built as ``dtype="float32"``."""
    matched: list[str] = []
    if not patterns:
        yield matched
        return
    layer_cls = keras.layers.Layer
    original = layer_cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if any(fnmatch(self.name, p) for p in patterns):
            self.dtype_policy = "float32"
            matched.append(self.name)

    layer_cls.__init__ = init
    try:
        yield matched
    finally:
        layer_cls.__init__ = original


def output_layers(model: Any) -> list[Any]:
    """The layers producing a functional or Sequential model's outputs (none for subclassed models)."""
    outputs = getattr(model, "_outputs", None) or getattr(model, "outputs", None) or []
    layers = []
    for tensor in backend.tf().nest.flatten(outputs):
        history = getattr(tensor, "_keras_history", None)
        if history is not None and history[0] not in layers and history[0] is not model:
            layers.append(history[0])
    return layers


def compute_layers(model: Any, skip: Sequence[str] = ()) -> list[Any]:
    """Dense/Conv layers in the order the model lists them, leaving out ``skip`` (by name)."""
    keras = backend.keras()
    kinds = tuple(getattr(keras.layers, k) for k in COMPUTE_LAYERS if hasattr(keras.layers, k))
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, kinds) and layer.name not in skip
    ]
