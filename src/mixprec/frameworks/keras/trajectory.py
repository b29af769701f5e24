"""Keras' differential training run and per-layer ranges (``Framework.trajectory`` and
``Framework.layer_ranges`` for Keras workloads).

A trajectory probes the first step (output, unscaled gradients, the loss scale that made them
finite), then trains from the strict-fp32 model's initial weights with the loss-scale optimizer
starting where it settles, as torch's check starts GradScaler. Ranges are forward only: each
layer's outputs from one eager forward pass with every layer watched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mixprec.frameworks.keras import backend
from mixprec.frameworks.keras.trainer import KerasTrainer, variable_names
from mixprec.numerics.compare import Trajectory
from mixprec.numerics.ranges import LayerRanges, RangeReport
from mixprec.numerics.trend import LayerSeries


def run_trajectory(
    trainer: KerasTrainer,
    batches: Sequence[Any],
    steps: int,
    weights: Sequence[Any],
    label: str,
    *,
    record: bool = False,
) -> Trajectory:
    """Probe the first step, then train ``steps`` steps from ``weights``; a candidate's failure is
    recorded in ``Trajectory.error``, never raised. With ``record``, every layer's forward ranges
    before every step (an eager forward pass on that step's batch: Keras' compiled step cannot be
    hooked) go into ``Trajectory.series``."""
    traj = Trajectory(label)
    try:
        trainer.reset(weights)
        out, grads, scale = trainer.first_step_probe(batches[0])
        traj.first_output = torch.from_numpy(out)
        traj.first_grads = {name: torch.from_numpy(g) for name, g in grads.items()}
        traj.probe_scale = scale
        if scale is not None and not all(np.isfinite(g).all() for g in grads.values()):
            scale = None  # no scale made the gradients finite: the scale did not settle, it gave up
        if scale is not None:  # start where the loss-scale optimizer settles, as torch's check does
            initial = float(trainer.optimizer.initial_scale)
            traj.warmup_skips = max(0, round(math.log2(initial / scale)))
        trainer.reset(weights, scale=scale)
        watch = trainer.candidate.spec.param_dtype is not None
        before = [v.numpy() for v in trainer.variables] if watch else []
        series: dict[str, LayerSeries] = {}
        for i in range(steps):
            if record:
                _record(series, forward_ranges(trainer, batches[i % len(batches)]), i)
            loss, applied = trainer.step(batches[i % len(batches)])
            traj.losses.append(loss)
            traj.stepped.append(applied)
            traj.scales.append(trainer.scale)
            if i == 0 and watch and applied:
                _count_stalls(traj, before, trainer, grads)
        traj.series = list(series.values())
    except Exception as exc:  # a candidate that crashes is a failed candidate, not a crashed check
        traj.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return traj


def _record(series: dict[str, LayerSeries], report: RangeReport, step: int) -> None:
    """Each layer's forward abs-max at ``step`` (NaN for the steps it did not run)."""
    for layer in report.layers:
        s = series.setdefault(layer.name, LayerSeries(layer.name, layer.type))
        s.forward += [math.nan] * (step - len(s.forward))
        s.forward.append(layer.forward.absmax if layer.forward.count else math.nan)


def _count_stalls(traj: Trajectory, before: list[np.ndarray], trainer: KerasTrainer, grads: dict) -> None:
    """Weights with a non-zero gradient that the first step left bit-identical (the update was
    below half an ulp of the half-precision weight)."""
    for name, old, var in zip(variable_names(trainer.variables), before, trainer.variables, strict=True):
        if name not in grads:
            continue
        had_grad = grads[name] != 0
        unchanged = var.numpy() == old
        traj.stall_counts[0] += int((unchanged & had_grad).sum())
        traj.stall_counts[1] += int(had_grad.sum())


def perturbed(weights: Sequence[np.ndarray], perturb: float) -> list[np.ndarray]:
    """Every floating weight times ``1 + perturb * N(0, 1)`` with a fixed seed (the chaos floor)."""
    if not perturb:
        return list(weights)
    rng = np.random.default_rng(1)
    return [
        (w * (1 + perturb * rng.standard_normal(w.shape))).astype(w.dtype)
        if np.issubdtype(w.dtype, np.floating)
        else w
        for w in weights
    ]


def forward_ranges(trainer: KerasTrainer, batch: tuple[Any, Any]) -> RangeReport:
    """Every layer's forward outputs, in the order the layers finished, from one eager forward pass;
    the first layer whose output is not all finite."""
    tf = backend.tf()
    seen: dict[str, LayerRanges] = {}
    first_nonfinite: list[str] = []
    layers = list(trainer.model._flatten_layers(include_self=False, recursive=True))
    for layer in layers:
        original = layer.call

        def call(*args: Any, _layer: Any = layer, _original: Any = original, **kwargs: Any) -> Any:
            out = _original(*args, **kwargs)
            tensors = [t for t in tf.nest.flatten(out) if hasattr(t, "dtype") and t.dtype.is_floating]
            if tensors:
                record = seen.setdefault(
                    _layer.name, LayerRanges(_layer.name, type(_layer).__name__, len(seen))
                )
                record.calls += 1
                for t in tensors:
                    nonfinite = record.forward.update(torch.from_numpy(np.asarray(t, dtype=np.float64)))
                    if nonfinite and not first_nonfinite:
                        first_nonfinite.append(_layer.name)
            return out

        object.__setattr__(layer, "call", call)
    try:
        with trainer.policy.scope(), tf.device(trainer.device):
            trainer.model(batch[0], training=True)
    finally:
        for layer in layers:
            layer.__dict__.pop("call", None)
    ordered = sorted(seen.values(), key=lambda r: r.order)
    return RangeReport(ordered, first_nonfinite_forward=first_nonfinite[0] if first_nonfinite else None)
