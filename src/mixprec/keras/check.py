"""`check` for Keras workloads: does a policy train like strict fp32, where does it overflow, and
which float32 layers fix it?

The same differential test as torch's (:mod:`mixprec.numerics.check`): a strict-fp32 reference
and every candidate start from the same weights and see the same batches; per step the loss, the
loss-scale optimizer's skips and scale; at the first step the SQNR of the output and of every
gradient; the chaos floor (two fp32 runs 2^-20 apart) scales the limits. The trajectories are
:class:`mixprec.numerics.compare.Trajectory` objects, so comparison and verdict are shared code.
The first layer whose forward output is inf/NaN is found by running the model eagerly with every
layer watched; the keep-fp32 search grows a set of Keras layer names from that evidence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from mixprec.errors import UsageError
from mixprec.hardware.device import detect
from mixprec.keras import backend
from mixprec.keras.policy import KerasPolicy, keras_support
from mixprec.keras.trainer import KerasTrainer, make_batches
from mixprec.keras.workload import KerasWorkload, workload_label
from mixprec.numerics.compare import Trajectory, compare
from mixprec.numerics.fix import search_keep_fp32
from mixprec.numerics.limits import FORMATS
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.numerics.verdict import (
    CHAOS_PERTURBATION,
    Floor,
    allowed_rel_loss_diff,
    default_thresholds,
    judge,
)
from mixprec.policy import Candidate, Thresholds
from mixprec.status import Status

Progress = Callable[[str], None]
FP32 = Candidate("fp32", framework="tensorflow")
# Updates of half-precision weights are watched for rounding loss on the first step.
_SEARCH_STEPS = 4
_MAX_SET = 8


@dataclass(frozen=True)
class LayerRange:
    """One layer's forward output in a run: its largest magnitude and whether it was all finite."""

    name: str
    absmax: float
    finite: bool
    type: str = ""  # the Keras layer class

    def headroom_bits(self, fmt: str) -> float:
        """log2 of the format's largest finite value over this output's largest magnitude."""
        if not self.finite:
            return -math.inf
        if self.absmax <= 0:
            return math.inf
        return math.log2(FORMATS[fmt].max_finite / self.absmax)


def forward_ranges(trainer: KerasTrainer, batch: tuple[Any, Any]) -> list[LayerRange]:
    """Every layer's output, in the order the layers finished, from one eager forward pass."""
    tf = backend.tf()
    seen: list[LayerRange] = []
    layers = list(trainer.model._flatten_layers(include_self=False, recursive=True))
    for layer in layers:
        original = layer.call

        def call(*args: Any, _layer: Any = layer, _original: Any = original, **kwargs: Any) -> Any:
            out = _original(*args, **kwargs)
            tensors = [t for t in tf.nest.flatten(out) if hasattr(t, "dtype") and t.dtype.is_floating]
            if tensors:
                values = [np.asarray(t, dtype=np.float64) for t in tensors]
                finite = all(bool(np.isfinite(v).all()) for v in values)
                absmax = max(float(np.nanmax(np.abs(v), initial=0.0)) for v in values)
                seen.append(LayerRange(_layer.name, absmax, finite, type(_layer).__name__))
            return out

        object.__setattr__(layer, "call", call)
    try:
        with trainer.policy.scope(), tf.device(trainer.device):
            trainer.model(batch[0], training=True)
    finally:
        for layer in layers:
            layer.__dict__.pop("call", None)
    return seen


def _perturbed(weights: Sequence[np.ndarray], perturb: float) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [
        (w * (1 + perturb * rng.standard_normal(w.shape))).astype(w.dtype)
        if np.issubdtype(w.dtype, np.floating)
        else w
        for w in weights
    ]


def _range_format(cand: Candidate) -> str:
    return cand.spec.range_format if cand.spec.range_format != "fp32" else "bf16"


class KerasChecker:
    """The fp32 reference, its per-layer ranges and the chaos floor, shared by every candidate."""

    def __init__(
        self,
        workload: KerasWorkload,
        device: str,
        batch_size: int,
        steps: int,
        thresholds: dict[str, Thresholds],
        progress: Progress,
        deadline: float = math.inf,
    ) -> None:
        self.workload, self.device, self.batch_size, self.steps = workload, device, batch_size, steps
        self.thresholds, self.progress, self.deadline = thresholds, progress, deadline
        self.batches = make_batches(workload, batch_size, 0, steps, device)
        progress("fp32 reference")
        reference = KerasTrainer(workload, FP32, device, self.batches[0])
        self.weights = reference.initial_weights
        self.reference = self.trajectory(reference, "fp32")
        if self.reference.error:
            raise UsageError(f"the fp32 reference run of {workload.name!r} failed: {self.reference.error}")
        reference.reset()
        self.reference_ranges = forward_ranges(reference, self.batches[0])
        progress("fp32 chaos floor")
        self.chaos = self.trajectory(reference, "fp32 chaos", _perturbed(self.weights, CHAOS_PERTURBATION))
        chaos = compare(self.reference, self.chaos)
        self.floor = (
            Floor(chaos.max_rel_loss_diff, chaos.output_sqnr_db, chaos.total_grad_sqnr_db)
            if not self.chaos.error
            else Floor()
        )

    def trajectory(
        self,
        trainer: KerasTrainer,
        label: str,
        weights: Sequence[Any] | None = None,
        steps: int | None = None,
    ) -> Trajectory:
        """Probe the first step, then train ``steps`` steps from ``weights`` (default: the reference's)."""
        traj = Trajectory(label)
        weights = self.weights if weights is None else weights
        try:
            trainer.reset(weights)
            out, grads, scale = trainer.first_step_probe(self.batches[0])
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
            for i in range(steps or self.steps):
                loss, applied = trainer.step(self.batches[i % len(self.batches)])
                traj.losses.append(loss)
                traj.stepped.append(applied)
                traj.scales.append(trainer.scale)
                if i == 0 and watch and applied:
                    _count_stalls(traj, before, trainer, grads)
        except Exception as exc:  # a candidate that crashes is a failed candidate, not a crashed check
            traj.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return traj

    def run(self, cand: Candidate, keep_fp32: Sequence[str] = (), steps: int | None = None) -> tuple:
        steps = steps or self.steps
        trial = replace(cand, keep_fp32=(*cand.keep_fp32, *keep_fp32))
        trainer: KerasTrainer | None = None
        try:
            trainer = KerasTrainer(self.workload, trial, self.device, self.batches[0], self.weights)
        except Exception as exc:  # a candidate that cannot even be built fails its check
            traj = Trajectory(trial.label, error=f"{type(exc).__name__}: {exc}")
        else:
            traj = self.trajectory(trainer, trial.label, steps=steps)
        ref = replace(self.reference, losses=self.reference.losses[:steps])
        cmp = compare(ref, traj)
        floor = replace(
            self.floor,
            rel_loss_diff=compare(
                ref, replace(self.chaos, losses=self.chaos.losses[:steps])
            ).max_rel_loss_diff,
        )
        passed, reason = judge(
            cmp, traj, self.thresholds[cand.policy], steps, floor, cand.spec.rounding_format
        )
        return passed, reason, cmp, traj, trainer

    def check(self, cand: Candidate, fix: bool) -> CandidateCheck:
        self.progress(cand.label)
        passed, reason, cmp, traj, trainer = self.run(cand)
        thr = self.thresholds[cand.policy]
        fmt = cand.spec.rounding_format
        result = CandidateCheck(
            candidate=cand,
            verdict=Status.PASS if passed else Status.FAIL,
            reason=reason,
            max_rel_loss_diff=cmp.max_rel_loss_diff,
            output_sqnr_db=cmp.output_sqnr_db,
            min_grad_sqnr_db=cmp.min_grad_sqnr_db,
            median_grad_sqnr_db=cmp.median_grad_sqnr_db,
            total_grad_sqnr_db=cmp.total_grad_sqnr_db,
            skipped_steps=cmp.skipped_steps,
            scaler_warmup_skips=traj.warmup_skips,
            stalled_update_fraction=traj.stalled_update_fraction,
            allowed_rel_loss_diff=allowed_rel_loss_diff(thr, self.floor.rel_loss_diff),
            required_output_sqnr_db=self.floor.required(
                thr.min_output_sqnr_db, self.floor.output_sqnr_db, fmt
            ),
            required_grad_sqnr_db=self.floor.required(thr.min_grad_sqnr_db, self.floor.grad_sqnr_db, fmt),
            losses=traj.losses,
            rel_loss_diff=cmp.rel_loss_diff,
            scales=traj.scales,
            worst_grads=sorted(cmp.grad_sqnr_db.items(), key=lambda kv: kv[1])[:5],
            thresholds=asdict(thr),
        )
        range_fmt = _range_format(cand)
        if trainer is not None:
            try:
                trainer.reset(self.weights)
                ranges = forward_ranges(trainer, self.batches[0])
                result.first_nonfinite_forward = next((r.name for r in ranges if not r.finite), None)
            except Exception as exc:  # ranges are evidence; their failure must not hide the verdict
                result.fix_note = f"per-layer ranges unavailable: {type(exc).__name__}: {exc}"
        result.worst_layers = [
            {
                "layer": r.name,
                "type": r.type,
                "format": range_fmt,
                "forward_absmax": r.absmax,
                "forward_headroom_bits": r.headroom_bits(range_fmt),
            }
            for r in sorted(self.reference_ranges, key=lambda r: r.headroom_bits(range_fmt))[:5]
        ]
        if not passed:
            if result.first_nonfinite_forward and "non-finite" in reason:
                result.reason += f"; first non-finite output in {result.first_nonfinite_forward!r}"
            overflow = result.first_nonfinite_forward or result.skipped_steps
            result.suggestion = (
                "fp16 overflows here: try bf16-mixed (fp32's range)"
                if cand.spec.range_format == "fp16" and overflow
                else "keep the failing layers in float32 (keep_fp32=[...]) or use fp32"
            )
            if fix and cand.spec.is_math_mode:
                result.fix_note = f"{cand.label} is a math mode: float32 layers cannot fix it; use fp32"
            elif fix and time.perf_counter() > self.deadline:
                result.fix_note = "keep_fp32 search skipped: time budget spent"
            elif fix:
                self._search_fix(cand, result, range_fmt)
        return result

    def _search_space(self, result: CandidateCheck, fmt: str) -> list[str]:
        """Layers to try in float32, most suspicious first: the first non-finite one, then those
        with the least headroom in the candidate's range format in the fp32 reference."""
        order: list[str] = []
        for name in [
            result.first_nonfinite_forward,
            *(r.name for r in sorted(self.reference_ranges, key=lambda r: r.headroom_bits(fmt))),
        ]:
            if name and name not in order:
                order.append(name)
        return order

    def _search_fix(self, cand: Candidate, result: CandidateCheck, fmt: str) -> None:
        """Grow a keep_fp32 set of layer names until the candidate passes, drop what is not needed,
        then verify over every checked step."""
        search_keep_fp32(
            self.run,
            cand,
            result,
            self._search_space(result, fmt),
            _MAX_SET,
            steps=self.steps,
            search_steps=min(self.steps, _SEARCH_STEPS),
            deadline=self.deadline,
            progress=self.progress,
            kind="float32 layers",
        )


def _count_stalls(traj: Trajectory, before: list[np.ndarray], trainer: KerasTrainer, grads: dict) -> None:
    """Weights with a non-zero gradient that the first step left bit-identical (the update was
    below half an ulp of the half-precision weight)."""
    names = [getattr(v, "path", None) or v.name for v in trainer.variables]
    for name, old, var in zip(names, before, trainer.variables, strict=True):
        if name not in grads:
            continue
        had_grad = grads[name] != 0
        unchanged = var.numpy() == old
        traj.stall_counts[0] += int((unchanged & had_grad).sum())
        traj.stall_counts[1] += int(had_grad.sum())


def make_checker(
    workload: KerasWorkload,
    *,
    steps: int = 8,
    batch_size: int | None = None,
    device: str | None = None,
    thresholds: dict[str, Thresholds] | None = None,
    progress: Progress | None = None,
    deadline: float = math.inf,
) -> KerasChecker:
    if not isinstance(workload, KerasWorkload):
        raise UsageError(f"mixprec.keras.check() takes a KerasWorkload, got {type(workload).__name__}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"steps must be an integer >= 1, got {steps!r}.")
    device = str(device or backend.default_device())
    merged = {**default_thresholds(), **(thresholds or {})}
    bs = batch_size or workload.default_batch_size
    return KerasChecker(workload, device, bs, steps, merged, progress or (lambda msg: None), deadline)


def check(
    workload: KerasWorkload,
    *,
    policies: Sequence[str | Candidate] = ("bf16-mixed", "fp16-mixed"),
    steps: int = 8,
    batch_size: int | None = None,
    device: str | None = None,
    fix: bool = False,
    thresholds: dict[str, Thresholds] | None = None,
    progress: Progress | None = None,
    deadline: float = math.inf,
    checker: KerasChecker | None = None,
) -> CheckResult:
    """Check each policy against the strict-fp32 reference on a Keras workload (see the module doc)."""
    checker = checker or make_checker(
        workload,
        steps=steps,
        batch_size=batch_size,
        device=device,
        thresholds=thresholds,
        progress=progress,
        deadline=deadline,
    )
    info = detect(checker.device)
    results = []
    for item in policies:
        cand = item if isinstance(item, Candidate) else Candidate(item, framework="tensorflow")
        if cand.framework != "tensorflow":
            cand = replace(cand, framework="tensorflow")
        support = keras_support(cand, info)
        if not support:
            results.append(
                CandidateCheck(cand, Status.UNSUPPORTED, support.reason, suggestion=support.suggestion)
            )
            continue
        KerasPolicy(cand)  # a clear error for a policy Keras cannot express
        results.append(checker.check(cand, fix))
    return CheckResult(
        workload=workload_label(checker.workload),
        device=checker.device,
        batch_size=checker.batch_size,
        steps=checker.steps,
        reference_losses=checker.reference.losses,
        chaos_floor_rel_loss_diff=checker.floor.rel_loss_diff,
        chaos_floor_sqnr_db={"output": checker.floor.output_sqnr_db, "grad": checker.floor.grad_sqnr_db},
        chaos_floor_losses=checker.chaos.losses,
        candidates=results,
        reference_layers=[
            {
                "layer": r.name,
                "forward_absmax": r.absmax,
                "forward_headroom_bits": {f: r.headroom_bits(f) for f in ("fp16", "bf16")},
            }
            for r in checker.reference_ranges
        ],
    )
