"""The Keras backend: :class:`~mixprec.frameworks.keras.workload.KerasWorkload` models trained by a
``tf.function`` step under a Keras dtype policy (``Candidate.framework == "tensorflow"``).

TensorFlow is imported on first use only (``import mixprec`` never imports it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from mixprec.errors import UsageError
from mixprec.frameworks.base import Framework, SessionBuilder, sized_defaults
from mixprec.frameworks.keras import backend
from mixprec.frameworks.keras.export import keras_code
from mixprec.frameworks.keras.policy import KerasPolicy, keras_support
from mixprec.frameworks.keras.session import KerasSession, build_keras_session
from mixprec.frameworks.keras.trainer import KerasTrainer, make_batches, reference_weights, variable_names
from mixprec.frameworks.keras.trajectory import forward_ranges, perturbed, run_trajectory
from mixprec.frameworks.keras.workload import KerasWorkload, load_keras_workload, workload_label
from mixprec.frameworks.session import BenchSettings, Session
from mixprec.hardware.device import DeviceInfo
from mixprec.numerics.compare import Trajectory
from mixprec.numerics.ranges import RangeReport
from mixprec.policy import POLICY_NAMES, Candidate, Support

# resnet50 at 64 px and batch 16: about 0.7 s per fp32 step on a 2-core CPU, so the default sweep
# and `tune` (tf.function tracing costs ~15 s per candidate) end within a few minutes.
CPU_DEFAULTS: dict[str, Any] = {"image_size": 64, "batch_size": 16, "steps": 4, "warmup": 1, "min_time": 1.0}
# `check` builds a model per candidate and trains three runs: the smallest images the CNNs take.
CHECK_DEFAULTS: dict[str, Any] = {"image_size": 32, "batch_size": 8}
_CNNS = ("resnet50", "vgg19", "densenet121")


class KerasFramework(Framework):
    """Keras 3 on TensorFlow: dtype policies with float32 layers, the ``LossScaleOptimizer``, the
    ``tf.function`` train step with or without XLA. Keras is NHWC already (no channels_last axis)
    and its optimizers have no implementation switch; there is no Keras linter."""

    name: ClassVar[str] = "tensorflow"
    title: ClassVar[str] = "Keras 3 on TensorFlow"
    workload_type: ClassVar[type] = KerasWorkload
    workload_name: ClassVar[str] = "mixprec.keras.KerasWorkload"
    compile_modes: ClassVar[tuple[str, ...]] = ("xla",)
    island_kind: ClassVar[str] = "float32 layers"
    scaler_name: ClassVar[str] = "LossScaleOptimizer"

    def __init__(self) -> None:
        # The last trainer built for a check, kept so the fp32 reference, its chaos run and its
        # ranges trace the train step once (tracing costs seconds per model), and the strict-fp32
        # initial weights every check run of that workload starts from.
        self._trainer: tuple[tuple[int, Candidate, str], KerasTrainer] | None = None
        self._weights: tuple[tuple[int, str], list[Any]] | None = None
        self._validated: set[tuple[int, int, str]] = set()  # workloads (and devices) that can train

    # ------------------------------------------------------------------ workloads
    def load_workload(self, target: str, **sizes: Any) -> KerasWorkload:
        return load_keras_workload(target, **sizes)

    def workload_label(self, workload: KerasWorkload) -> str:
        return workload_label(workload)

    def validate_workload(
        self, workload: KerasWorkload, device: str, batch_size: int, *, budget: Any = None
    ) -> None:
        """The strict-fp32 model, built (called on one batch where its layers build lazily): a model
        with no trainable weight is refused, as the torch backend refuses one whose parameters are all
        frozen (nothing would train, and every policy would match fp32 trivially)."""
        key = (id(workload), id(workload.make_model), device)
        if key in self._validated:
            return
        tf = backend.tf()
        policy = KerasPolicy(Candidate("fp32", framework=self.name))
        self._trainer = None  # building clears the Keras session a cached trainer was traced in
        with tf.device(backend.device_name(device)):
            model = policy.build_model(workload.make_model, 0)
            if not model.built:
                model(tf.constant(workload.batch(batch_size, 0)[0]), training=False)
        if not model.trainable_weights:
            raise UsageError(
                f"the Keras model of {workload.name!r} has no trainable weights ({len(model.weights)} "
                "weights, all frozen): nothing would train, and no precision can be measured on it; make "
                "the layers to train trainable (layer.trainable = True, or trainable=True when built)."
            )
        self._validated.add(key)

    def cli_defaults(self, device: str, command: str) -> dict[str, Any]:
        return sized_defaults(device, command, CPU_DEFAULTS, CHECK_DEFAULTS)

    def sized_by_defaults(self, target: str | None, is_factory: bool, defaults: dict[str, Any]) -> str | None:
        return "image_size" if not is_factory and (target or "resnet50") in _CNNS else None

    # ------------------------------------------------------------------ devices
    def resolve_device(self, device: Any) -> str:
        dev = str(device or backend.default_device())
        backend.device_name(dev)  # a clear error for a device TensorFlow cannot see
        return dev

    def threads(self) -> int:
        return backend.tf().config.threading.get_intra_op_parallelism_threads() or super().threads()

    def use_threads(self, threads: int) -> None:
        """Nothing: TensorFlow fixes its threads when its runtime starts (validating the workload
        started it in this process), and a candidate process sets its own."""

    def environment(self, device: str | None, *, full: bool = False) -> dict[str, Any]:
        from mixprec.frameworks.keras.environment import collect

        return collect(device, full=full)

    def peaks(self, info: DeviceInfo, keys: Sequence[str]) -> dict[str, tuple[float | None, str]]:
        return {}  # no FLOP count, so no MFU: the peaks would only be measured for nothing

    # ------------------------------------------------------------------ candidates
    def support(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> Support:
        return keras_support(candidate, info)

    def tune_candidates(self, workload: KerasWorkload, info: DeviceInfo) -> list[Candidate]:
        """Natively supported policies only: tracing a candidate costs seconds, and an emulated
        format is slower than fp32 here anyway (bench measures them on request)."""
        cands = [Candidate(name, framework=self.name) for name in POLICY_NAMES]
        return [c for c in cands if (s := keras_support(c, info)) and s.native]

    # ------------------------------------------------------------------ measuring
    def make_batches(
        self, workload: KerasWorkload, batch_size: int, device: str, seed: int, n: int
    ) -> list[Any]:
        return make_batches(workload, batch_size, device, seed, n)

    def session(
        self, workload: KerasWorkload, candidate: Candidate, settings: BenchSettings, batches: list | None
    ) -> Session:
        return KerasSession(workload, candidate, settings, batches)

    def session_builder(self) -> SessionBuilder:
        return build_keras_session

    def preload(self, spec: Any) -> tuple[str, ...]:
        # TensorFlow imported once in the fork server, quietly, not again in every candidate's process
        return ("mixprec.frameworks.keras.preloaded", "mixprec.frameworks.keras.session")

    # ------------------------------------------------------------------ checking
    def _checked_trainer(
        self, workload: KerasWorkload, candidate: Candidate, batch: Any, device: str
    ) -> tuple[KerasTrainer, list[Any]]:
        """A trainer for ``candidate`` and the fp32 initial weights every check run starts from."""
        key = (id(workload), candidate, device)
        if self._trainer is None or self._trainer[0] != key:
            self._trainer = None  # free the previous model before building the next
            KerasPolicy(candidate)  # a clear error for a policy Keras cannot express
            weights = self._reference_weights(workload, candidate, device)
            self._trainer = (key, KerasTrainer(workload, candidate, device, batch, weights))
        trainer = self._trainer[1]
        if self._weights is None or self._weights[0] != (id(workload), device):
            self._weights = ((id(workload), device), trainer.initial_weights)
        return trainer, self._weights[1]

    def _reference_weights(
        self, workload: KerasWorkload, candidate: Candidate, device: str
    ) -> list[Any] | None:
        """The strict-fp32 model's initial weights, copied into every other candidate's model (seeded
        building gives the same weights for mixed policies, not for half-precision variables)."""
        if self._weights is not None and self._weights[0] == (id(workload), device):
            return self._weights[1]
        if candidate.policy == "fp32":
            return None  # this trainer's own initial weights are the reference
        return reference_weights(workload, Candidate("fp32", framework=self.name), device, always=True)

    def trajectory(
        self,
        workload: KerasWorkload,
        candidate: Candidate,
        batches: Sequence[Any],
        steps: int,
        device: str,
        *,
        perturb: float = 0.0,
    ) -> Trajectory:
        try:
            trainer, weights = self._checked_trainer(workload, candidate, batches[0], device)
        except Exception as exc:  # a candidate that cannot even be built fails its check
            return Trajectory(candidate.label, error=f"{type(exc).__name__}: {exc}")
        return run_trajectory(
            trainer, batches, steps, perturbed(weights, perturb), candidate.label, record=not perturb
        )

    def layer_ranges(
        self, workload: KerasWorkload, candidate: Candidate, batch: Any, device: str, loss_scale: float | None
    ) -> RangeReport:
        trainer, weights = self._checked_trainer(workload, candidate, batch, device)
        trainer.reset(weights)
        return forward_ranges(trainer, batch)

    def island_names(self, workload: KerasWorkload) -> tuple[list[str], dict[str, str]]:
        if self._trainer is None or self._trainer[0][0] != id(workload):
            return [], {}
        model = self._trainer[1].model
        names = [layer.name for layer in model._flatten_layers(include_self=False, recursive=True)]
        # 'block/fc1/kernel' -> the layer 'fc1'
        owners = {
            path: path.split("/")[-2] for path in variable_names(model.trainable_variables) if "/" in path
        }
        return names, owners

    def fix_snippet(self, candidate: Candidate, keep_fp32: Sequence[str]) -> str:
        # Keras islands are layers built in float32
        return f'build the Keras layers {list(keep_fp32)!r} with dtype="float32" under {candidate.policy}'

    # ------------------------------------------------------------------ after the pick
    def exports(
        self, candidate: Candidate, device: str, workload: Any = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        return {"keras": keras_code(candidate)}, {
            "pytorch": "a TensorFlow/Keras recommendation; the torch exports do not apply"
        }
