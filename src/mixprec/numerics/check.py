"""`check`: does a policy train like fp32? Where does it break, and which fp32 islands fix it?

For every candidate: a differential training run against a strict-fp32 reference (see
``compare``), per-layer ranges under the candidate (first non-finite module forward and
backward), a verdict against per-policy thresholds, and on request a search for a small
``keep_fp32`` set that makes a failing candidate pass, verified by re-running the check.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch

from mixprec.errors import UsageError
from mixprec.hardware.device import detect, resolve_device
from mixprec.measure.runner import make_batches
from mixprec.numerics.compare import compare, run_trajectory
from mixprec.numerics.fix import search_keep_fp32
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.numerics.verdict import (
    CHAOS_PERTURBATION,
    Floor,
    allowed_rel_loss_diff,
    default_thresholds,
    judge,
)
from mixprec.policy import Candidate, Policy, Thresholds, check_support, get_policy
from mixprec.policy.support import fp8_predictable
from mixprec.status import Status
from mixprec.workload import Workload, validate_workload

Progress = Callable[[str], None]
Events = Callable[[dict[str, Any]], None]


def _emulation_context(fmt: str | None) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    if fmt is None:
        return None
    from mixprec.numerics.emulate import emulate

    return lambda: emulate(fmt)


def _ranges(workload: Workload, policy: Policy, batch: Any, context: Any, loss_scale: float | None) -> Any:
    """Per-layer ranges of one forward/backward of a fresh prepared copy under ``policy``."""
    from mixprec.numerics.ranges import collect_ranges

    model = policy.prepare(copy.deepcopy(workload.model))
    model.train()
    ctx = context or contextlib.nullcontext

    def step() -> torch.Tensor:
        with ctx(), policy.autocast():
            return workload.loss_fn(model, batch)

    with policy.precision_scope(), ctx():
        return collect_ranges(model, step, loss_scale=loss_scale)


def _worst_layers(report: Any, fmt: str, n: int = 5) -> list[dict[str, Any]]:
    rows = []
    for layer in report.worst(n, fmt):
        fwd, bwd = layer.forward, layer.backward
        rows.append(
            {
                "layer": layer.name,
                "type": layer.type,
                "format": fmt,
                "forward_absmax": fwd.absmax,
                "forward_headroom_bits": fwd.headroom_bits(fmt),
                "forward_overflow": fwd.overflow_fraction(fmt),
                "backward_absmax": bwd.absmax,
                "backward_headroom_bits": bwd.headroom_bits(fmt),
                "backward_underflow": bwd.underflow_fraction(fmt),
            }
        )
    return rows


def _layer_headroom(report: Any) -> list[dict[str, Any]]:
    """Per layer, in execution order: headroom in bits per low-precision format, both passes."""
    from mixprec.numerics.limits import LOW_PRECISION_FORMATS

    return [
        {
            "layer": layer.name,
            "type": layer.type,
            "forward_headroom_bits": {f: layer.forward.headroom_bits(f) for f in LOW_PRECISION_FORMATS},
            "backward_headroom_bits": {f: layer.backward.headroom_bits(f) for f in LOW_PRECISION_FORMATS},
        }
        for layer in report.layers
        if layer.name  # the root's output is the loss input; it is the last layer anyway
    ]


def _rounding_format(cand: Candidate) -> str:
    """The format whose rounding bounds the candidate's precision (an emulated format's own)."""
    return cand.emulate or cand.spec.rounding_format


def _range_format(cand: Candidate) -> str:
    """The format whose exponent range limits the candidate (tf32 has bf16's range)."""
    if cand.emulate:
        return "bf16" if cand.emulate == "tf32" else cand.emulate
    return cand.spec.range_format if cand.spec.range_format != "fp32" else "bf16"


class _Checker:
    """Holds what every candidate shares: batches, the reference run and its ranges."""

    def __init__(
        self,
        workload: Workload,
        device: torch.device,
        batch_size: int,
        steps: int,
        thresholds: dict[str, Thresholds],
        progress: Progress,
        deadline: float = math.inf,
    ) -> None:
        self.workload, self.device, self.steps = workload, device, steps
        self.deadline = deadline  # time.perf_counter() value after which searches stop
        self.batch_size = batch_size
        self.thresholds = thresholds
        self.progress = progress
        self.batches = make_batches(workload, batch_size, device, 0, steps)
        progress("fp32 reference")
        self.reference = run_trajectory(workload, get_policy("fp32", device=device), self.batches, steps)
        broken = _broken_reference(self.reference)
        if broken:
            # The user's bug, not a precision verdict: no candidate can be judged against it.
            raise UsageError(
                f"the workload itself fails in strict fp32: {broken}; no policy can be judged against "
                f"it. Fix {workload.name!r} so it trains in fp32 first (mixprec --debug shows where)."
            )
        self.reference_ranges = _ranges(
            workload, get_policy("fp32", device=device), self.batches[0], None, None
        )
        progress("fp32 chaos floor")
        self.chaos = run_trajectory(
            workload, get_policy("fp32", device=device), self.batches, steps, perturb=CHAOS_PERTURBATION
        )
        chaos_cmp = compare(self.reference, self.chaos)
        self.floor = (
            Floor(chaos_cmp.max_rel_loss_diff, chaos_cmp.output_sqnr_db, chaos_cmp.total_grad_sqnr_db)
            if not self.chaos.error
            else Floor()
        )

    def policy(self, cand: Candidate, keep_fp32: Sequence[str] = ()) -> Policy:
        keep = [*cand.keep_fp32, *keep_fp32]
        options: dict[str, Any] = {"keep_fp32": keep} if keep else {}
        # check() decided it may run here (supported, or an fp8 prediction)
        return get_policy(cand.policy, device=self.device, check=False, **options)

    def run(self, cand: Candidate, keep_fp32: Sequence[str] = (), steps: int | None = None) -> tuple:
        steps = steps or self.steps
        policy = self.policy(cand, keep_fp32)
        traj = run_trajectory(
            self.workload,
            policy,
            self.batches,
            steps,
            context=_emulation_context(cand.emulate),
            label=cand.label,
            compile_mode=cand.compile,
        )
        ref = replace(self.reference, losses=self.reference.losses[:steps])
        cmp = compare(ref, traj)
        floor = replace(
            self.floor,
            rel_loss_diff=compare(
                ref, replace(self.chaos, losses=self.chaos.losses[:steps])
            ).max_rel_loss_diff,
        )
        passed, reason = judge(
            cmp, traj, self.thresholds[cand.threshold_key], steps, floor, _rounding_format(cand)
        )
        return passed, reason, cmp, traj, policy

    def check(self, cand: Candidate, fix: bool) -> CandidateCheck:
        self.progress(cand.label)
        passed, reason, cmp, traj, policy = self.run(cand)
        thr = self.thresholds[cand.threshold_key]
        result = CandidateCheck(
            candidate=cand,
            verdict="pass" if passed else "fail",
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
                thr.min_output_sqnr_db, self.floor.output_sqnr_db, _rounding_format(cand)
            ),
            required_grad_sqnr_db=self.floor.required(
                thr.min_grad_sqnr_db, self.floor.grad_sqnr_db, _rounding_format(cand)
            ),
            losses=traj.losses,
            rel_loss_diff=cmp.rel_loss_diff,
            scales=traj.scales,
            worst_grads=sorted(cmp.grad_sqnr_db.items(), key=lambda kv: kv[1])[:5],
            thresholds=asdict(thr),
        )
        fmt = _range_format(cand)
        try:
            ranges = _ranges(
                self.workload, policy, self.batches[0], _emulation_context(cand.emulate), traj.probe_scale
            )
            result.first_nonfinite_forward = ranges.first_nonfinite_forward
            result.first_nonfinite_backward = ranges.first_nonfinite_backward
            result.grad_underflow_fp16 = dict(ranges.grad_underflow_fp16)
        except Exception as exc:  # ranges are evidence; their failure must not hide the verdict
            result.fix_note = f"per-layer ranges unavailable: {type(exc).__name__}: {exc}"
        result.worst_layers = _worst_layers(self.reference_ranges, fmt)
        if not passed:
            result.suggestion = self._suggest(cand, result, fmt)
            if result.first_nonfinite_forward and "non-finite" in reason:
                result.reason += f"; first non-finite output in {result.first_nonfinite_forward!r}"
            if fix and cand.spec.is_math_mode:
                result.fix_note = (
                    f"{cand.label} is a global fp32 math mode (no autocast): fp32 islands cannot fix it; "
                    "use fp32 or a *-mixed policy"
                )
            elif fix and time.perf_counter() > self.deadline:
                result.fix_note = "keep_fp32 search skipped: time budget spent"
            elif fix:
                self._search_fix(cand, result, fmt)
        return result

    @staticmethod
    def _suggest(cand: Candidate, result: CandidateCheck, fmt: str) -> str:
        overflow = result.first_nonfinite_forward or result.first_nonfinite_backward or result.skipped_steps
        if fmt == "fp16" and overflow:
            return "fp16 overflows here: try bf16-mixed (same speed class, fp32's range)"
        if fmt == "bf16":
            return "bf16 loses too much precision here: try fp16-mixed or tf32"
        return "keep the failing layers in fp32 (keep_fp32=[...]) or use fp32/tf32"

    # ---------------------------------------------------------------- keep-fp32 search
    def _search_space(self, result: CandidateCheck, fmt: str) -> list[str]:
        """Modules to try in fp32, most suspicious first: located non-finite modules, then the
        layers with the least headroom in this format, then those with the worst gradients."""
        names = [n for n, m in self.workload.model.named_modules() if n]
        ordered: list[str] = []

        def add(name: str | None) -> None:
            if name and name in names and name not in ordered:
                ordered.append(name)

        add(result.first_nonfinite_forward)
        add(result.first_nonfinite_backward)
        for layer in self.reference_ranges.worst(len(names), fmt):
            add(layer.name)
        param_owner = {n: n.rsplit(".", 1)[0] for n, _ in self.workload.model.named_parameters() if "." in n}
        for pname, _ in result.worst_grads:
            add(param_owner.get(pname))
        return ordered

    def _search_fix(self, cand: Candidate, result: CandidateCheck, fmt: str, max_set: int = 8) -> None:
        """Grow a keep_fp32 set from the evidence until the candidate passes, then shrink it."""
        search_keep_fp32(
            self.run,
            cand,
            result,
            self._search_space(result, fmt),
            max_set,
            steps=self.steps,
            search_steps=min(self.steps, 4),
            deadline=self.deadline,
            progress=self.progress,
        )


def _broken_reference(reference: Any) -> str:
    """Why the strict-fp32 reference cannot serve as one (it raised, or its loss is not finite),
    or ''."""
    if reference.error:
        return reference.error
    bad = next((i for i, loss in enumerate(reference.losses) if not math.isfinite(loss)), None)
    if bad is not None:
        return f"its loss is {reference.losses[bad]} at step {bad}"
    if not reference.losses:
        return "it recorded no training step"
    return ""


def _plan(policies: Sequence[str | Candidate], emulate_fmts: Sequence[str]) -> list[Candidate]:
    cands = [p if isinstance(p, Candidate) else Candidate(p) for p in policies]
    return cands + [Candidate("fp32", emulate=fmt) for fmt in emulate_fmts]


def make_checker(
    workload: Workload,
    *,
    steps: int = 8,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    thresholds: dict[str, Thresholds] | None = None,
    progress: Progress | None = None,
    deadline: float = math.inf,
) -> _Checker:
    """Run the fp32 reference, its per-layer ranges and the chaos floor once, for many checks."""
    if not isinstance(workload, Workload):
        raise UsageError(f"check() takes a mixprec.Workload, got {type(workload).__name__}.")
    if not isinstance(steps, int) or steps < 1:
        raise UsageError(f"steps must be an integer >= 1, got {steps!r}.")
    dev = resolve_device(device)
    merged = {**default_thresholds(), **(thresholds or {})}
    bs = batch_size or workload.default_batch_size
    (progress or (lambda msg: None))("the workload: one strict-fp32 step")
    validate_workload(workload, device=dev, batch_size=bs)
    return _Checker(workload, dev, bs, steps, merged, progress or (lambda msg: None), deadline)


def check(
    workload: Workload,
    *,
    policies: Sequence[str | Candidate] = ("bf16-mixed", "fp16-mixed"),
    emulate: Sequence[str] = (),
    steps: int = 8,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    fix: bool = False,
    thresholds: dict[str, Thresholds] | None = None,
    progress: Progress | None = None,
    deadline: float = math.inf,
    checker: _Checker | None = None,
    events: Events | None = None,
) -> CheckResult:
    """Check each policy (and each emulated format) against an fp32 reference on ``workload``.

    ``deadline`` (a ``time.perf_counter()`` value) stops keep-fp32 searches once passed.
    ``checker`` (from :func:`make_checker`) reuses an fp32 reference, its ranges and the chaos
    floor across calls, e.g. when candidates are checked one at a time. ``events`` receives
    ``{"event": "verdict", "check": CandidateCheck, "index": i, "count": n}`` as each candidate
    is judged. The workload is validated first (:func:`mixprec.workload.validate_workload`).
    """
    if checker is None:
        checker = make_checker(
            workload,
            steps=steps,
            batch_size=batch_size,
            device=device,
            thresholds=thresholds,
            progress=progress,
            deadline=deadline,
        )
    workload, dev, steps, bs = checker.workload, checker.device, checker.steps, checker.batch_size
    info = detect(dev)
    cands = _plan(policies, emulate)
    results = []
    for index, cand in enumerate(cands):
        support = check_support(cand.policy, info)
        if support:
            results.append(checker.check(cand, fix))
        elif fp8_predictable(cand.policy, info):
            predicted = checker.check(cand, fix)
            predicted.predicted = (
                f"numerics predicted on {dev.type}: torchao's {cand.spec.fp8_recipe} fp8 recipe run here "
                "with the scales and fp8 casts an fp8 GPU applies (torch._scaled_mm reference kernels); "
                f"speed is not measurable here ({support.reason.split(';')[0]})"
            )
            results.append(predicted)
        else:
            results.append(
                CandidateCheck(cand, Status.UNSUPPORTED, support.reason, suggestion=support.suggestion)
            )
        if events is not None:
            events({"event": "verdict", "check": results[-1], "index": index, "count": len(cands)})
    return CheckResult(
        workload=str(workload.name),
        device=str(dev),
        batch_size=bs,
        steps=steps,
        reference_losses=checker.reference.losses,
        chaos_floor_rel_loss_diff=checker.floor.rel_loss_diff,
        chaos_floor_sqnr_db={"output": checker.floor.output_sqnr_db, "grad": checker.floor.grad_sqnr_db},
        chaos_floor_losses=checker.chaos.losses,
        candidates=results,
        reference_layers=_layer_headroom(checker.reference_ranges),
    )
