"""`check`: does a policy train like fp32? Where does it break, and which fp32 islands fix it?

For every candidate, in any framework: a differential training run against a strict-fp32
reference (the backend's ``trajectory``, compared by :mod:`mixprec.numerics.compare`), per-layer
ranges under the candidate (the first non-finite layer forward and backward), a verdict against
per-policy thresholds scaled by the chaos floor (:mod:`mixprec.numerics.verdict`), and on request
a search for a small ``keep_fp32`` set that makes a failing candidate pass, verified by re-running
the check (:mod:`mixprec.numerics.fix`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from mixprec.budget import Budget
from mixprec.errors import UsageError
from mixprec.events import Events, ignore
from mixprec.frameworks import Framework, framework_of
from mixprec.hardware.device import detect
from mixprec.numerics.compare import Comparison, Trajectory, compare
from mixprec.numerics.fix import search_keep_fp32
from mixprec.numerics.limits import LOW_PRECISION_FORMATS
from mixprec.numerics.ranges import RangeReport
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.numerics.verdict import (
    CHAOS_PERTURBATION,
    Floor,
    allowed_rel_loss_diff,
    default_thresholds,
    judge,
)
from mixprec.policy import Candidate, Thresholds
from mixprec.policy.registry import CHECK_DEFAULT
from mixprec.status import Status

MAX_FIX_SET = 8  # the keep-fp32 search tries at most this many layers
SEARCH_STEPS = 4  # steps of each trial run of the search (the found set is verified over all)


def rounding_format(cand: Candidate) -> str:
    """The format whose rounding bounds the candidate's precision (an emulated format's own)."""
    return cand.emulate or cand.spec.rounding_format


def range_format(cand: Candidate) -> str:
    """The format whose exponent range limits the candidate (tf32 has bf16's range)."""
    if cand.emulate:
        return "bf16" if cand.emulate == "tf32" else cand.emulate
    return cand.spec.range_format if cand.spec.range_format != "fp32" else "bf16"


def worst_layers(report: RangeReport, fmt: str, n: int = 5) -> list[dict[str, Any]]:
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
                "backward_absmax": bwd.absmax if bwd.count else None,
                "backward_headroom_bits": bwd.headroom_bits(fmt),
                "backward_underflow": bwd.underflow_fraction(fmt) if bwd.count else None,
            }
        )
    return rows


def layer_headroom(report: RangeReport) -> list[dict[str, Any]]:
    """Per layer, in execution order: headroom in bits per low-precision format, both passes (the
    backward one None where the framework records forward ranges only)."""
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


class Checker:
    """What every candidate of one workload shares: its backend, batches, the strict-fp32
    reference run, its per-layer ranges and the chaos floor."""

    def __init__(
        self,
        workload: Any,
        framework: Framework,
        device: str,
        batch_size: int,
        steps: int,
        thresholds: dict[str, Thresholds],
        events: Events,
        budget: Budget,
    ) -> None:
        self.workload, self.framework, self.device, self.steps = workload, framework, device, steps
        self.batch_size, self.thresholds, self.events, self.budget = batch_size, thresholds, events, budget
        self.batches = framework.make_batches(workload, batch_size, device, 0, steps)
        baseline = framework.baseline
        self.stage("fp32 reference")
        self.reference = framework.trajectory(workload, baseline, self.batches, steps, device)
        broken = broken_reference(self.reference)
        if broken:
            # The user's bug, not a precision verdict: no candidate can be judged against it.
            raise UsageError(
                f"the workload itself fails in strict fp32: {broken}; no policy can be judged against "
                f"it. Fix {getattr(workload, 'name', 'it')!r} so it trains in fp32 first (mixprec --debug "
                "shows where)."
            )
        self.reference_ranges = framework.layer_ranges(workload, baseline, self.batches[0], device, None)
        self.stage("fp32 chaos floor")
        self.chaos = framework.trajectory(
            workload, baseline, self.batches, steps, device, perturb=CHAOS_PERTURBATION
        )
        chaos = compare(self.reference, self.chaos)
        self.floor = (
            Floor(chaos.max_rel_loss_diff, chaos.output_sqnr_db, chaos.total_grad_sqnr_db)
            if not self.chaos.error
            else Floor()
        )

    def stage(self, text: str) -> None:
        self.events({"event": "stage", "text": f"checking {text}"})

    def run(
        self, cand: Candidate, keep_fp32: Sequence[str] = (), steps: int | None = None
    ) -> tuple[bool, str, Comparison, Trajectory]:
        """Train ``cand`` (with ``keep_fp32`` added) ``steps`` steps next to the reference; the verdict."""
        steps = steps or self.steps
        trial = replace(cand, keep_fp32=(*cand.keep_fp32, *keep_fp32))
        traj = self.framework.trajectory(self.workload, trial, self.batches, steps, self.device)
        ref = replace(self.reference, losses=self.reference.losses[:steps])
        cmp = compare(ref, traj)
        chaos = compare(ref, replace(self.chaos, losses=self.chaos.losses[:steps]))
        floor = replace(self.floor, rel_loss_diff=chaos.max_rel_loss_diff)
        passed, reason = judge(
            cmp, traj, self.thresholds[cand.threshold_key], steps, floor, rounding_format(cand)
        )
        return passed, reason, cmp, traj

    def check(self, cand: Candidate, fix: bool) -> CandidateCheck:
        self.stage(cand.label)
        passed, reason, cmp, traj = self.run(cand)
        thr = self.thresholds[cand.threshold_key]
        fmt = rounding_format(cand)
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
        rfmt = range_format(cand)
        try:
            ranges = self.framework.layer_ranges(
                self.workload, cand, self.batches[0], self.device, traj.probe_scale
            )
            result.first_nonfinite_forward = ranges.first_nonfinite_forward
            result.first_nonfinite_backward = ranges.first_nonfinite_backward
            result.grad_underflow_fp16 = dict(ranges.grad_underflow_fp16)
        except Exception as exc:  # ranges are evidence; their failure must not hide the verdict
            result.fix_note = f"per-layer ranges unavailable: {type(exc).__name__}: {exc}"
        result.worst_layers = worst_layers(self.reference_ranges, rfmt)
        if not passed:
            result.suggestion = self.suggest(cand, result, rfmt)
            if result.first_nonfinite_forward and "non-finite" in reason:
                result.reason += f"; first non-finite output in {result.first_nonfinite_forward!r}"
            if fix and cand.spec.is_math_mode:
                result.fix_note = (
                    f"{cand.label} is a global fp32 math mode (no autocast): fp32 islands cannot fix it; "
                    "use fp32 or a *-mixed policy"
                )
            elif fix and self.budget.expired():
                result.fix_note = "keep_fp32 search skipped: time budget spent"
            elif fix:
                self.search_fix(cand, result, rfmt)
        return result

    def suggest(self, cand: Candidate, result: CandidateCheck, fmt: str) -> str:
        overflow = result.first_nonfinite_forward or result.first_nonfinite_backward or result.skipped_steps
        if fmt == "fp16" and overflow:
            return "fp16 overflows here: try bf16-mixed (same speed class, fp32's range)"
        if fmt == "bf16":
            return "bf16 loses too much precision here: try fp16-mixed or tf32"
        return "keep the failing layers in fp32 (keep_fp32=[...]) or use fp32/tf32"

    # ---------------------------------------------------------------- keep-fp32 search
    def search_space(self, result: CandidateCheck, fmt: str) -> list[str]:
        """What to try in fp32, most suspicious first: located non-finite layers, then the layers with
        the least headroom in this format, then those with the worst gradients."""
        names, owners = self.framework.island_names(self.workload)
        known = set(names)
        ordered: list[str] = []

        def add(name: str | None) -> None:
            if name and name in known and name not in ordered:
                ordered.append(name)

        add(result.first_nonfinite_forward)
        add(result.first_nonfinite_backward)
        for layer in self.reference_ranges.worst(len(names), fmt):
            add(layer.name)
        for pname, _ in result.worst_grads:
            add(owners.get(pname))
        return ordered

    def search_fix(self, cand: Candidate, result: CandidateCheck, fmt: str) -> None:
        """Grow a keep_fp32 set from the evidence until the candidate passes, then shrink it."""
        search_keep_fp32(
            self.run,
            cand,
            result,
            self.search_space(result, fmt),
            MAX_FIX_SET,
            steps=self.steps,
            search_steps=min(self.steps, SEARCH_STEPS),
            deadline=self.budget.deadline,
            stage=self.stage,
            kind=self.framework.island_kind,
        )

    def result(self, results: list[CandidateCheck]) -> CheckResult:
        return CheckResult(
            workload=self.framework.workload_label(self.workload),
            device=self.device,
            batch_size=self.batch_size,
            steps=self.steps,
            reference_losses=self.reference.losses,
            chaos_floor_rel_loss_diff=self.floor.rel_loss_diff,
            chaos_floor_sqnr_db={"output": self.floor.output_sqnr_db, "grad": self.floor.grad_sqnr_db},
            chaos_floor_losses=self.chaos.losses,
            candidates=results,
            reference_layers=layer_headroom(self.reference_ranges),
        )


def broken_reference(reference: Trajectory) -> str:
    """Why the strict-fp32 reference cannot serve as one (it raised, or its loss is not finite), or ''."""
    if reference.error:
        return reference.error
    bad = next((i for i, loss in enumerate(reference.losses) if not math.isfinite(loss)), None)
    if bad is not None:
        return f"its loss is {reference.losses[bad]} at step {bad}"
    if not reference.losses:
        return "it recorded no training step"
    return ""


def make_checker(
    workload: Any,
    *,
    steps: int = 8,
    batch_size: int | None = None,
    device: Any = None,
    thresholds: dict[str, Thresholds] | None = None,
    events: Events | None = None,
    budget: Budget | None = None,
) -> Checker:
    """Run the fp32 reference, its per-layer ranges and the chaos floor once, for many checks."""
    framework = framework_of(workload)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"steps must be an integer >= 1, got {steps!r}.")
    dev = framework.resolve_device(device)
    events = events or ignore
    bs = batch_size or framework.default_batch_size(workload)
    events({"event": "stage", "text": "checking the workload: one strict-fp32 step"})
    framework.validate_workload(workload, dev, bs)
    merged = {**default_thresholds(), **(thresholds or {})}
    return Checker(workload, framework, dev, bs, steps, merged, events, budget or Budget.unlimited())


def candidates_of(
    framework: Framework, policies: Sequence[str | Candidate], emulate: Sequence[str]
) -> list[Candidate]:
    """The candidates ``policies`` (names or Candidates) and ``emulate`` (formats) name, validated."""
    cands = [p if isinstance(p, Candidate) else Candidate(p, framework=framework.name) for p in policies] + [
        Candidate("fp32", emulate=fmt, framework=framework.name) for fmt in emulate
    ]
    return [framework.validate(c) for c in cands]


def check(
    workload: Any,
    *,
    policies: Sequence[str | Candidate] = CHECK_DEFAULT,
    emulate: Sequence[str] = (),
    steps: int = 8,
    batch_size: int | None = None,
    device: Any = None,
    fix: bool = False,
    thresholds: dict[str, Thresholds] | None = None,
    events: Events | None = None,
    budget: Budget | None = None,
    checker: Checker | None = None,
) -> CheckResult:
    """Check each policy (and each emulated format) against a strict-fp32 reference on ``workload``
    (a :class:`mixprec.Workload` or another framework's, e.g. ``mixprec.keras.KerasWorkload``).

    ``budget`` stops keep-fp32 searches once spent. ``checker`` (from :func:`make_checker`) reuses an
    fp32 reference, its ranges and the chaos floor across calls, e.g. when candidates are checked
    one at a time. ``events`` receives 'stage' events and a ``{"event": "verdict", "check":
    CandidateCheck, "index": i, "count": n}`` as each candidate is judged. The workload is
    validated first (one strict-fp32 step).
    """
    if checker is None:
        framework = framework_of(workload)
        cands = candidates_of(framework, policies, emulate)  # bad names fail before the reference runs
        checker = make_checker(
            workload,
            steps=steps,
            batch_size=batch_size,
            device=device,
            thresholds=thresholds,
            events=events,
            budget=budget,
        )
    else:
        cands = candidates_of(checker.framework, policies, emulate)
    framework, events = checker.framework, events or checker.events
    info = detect(checker.device)
    results = []
    for index, cand in enumerate(cands):
        support = framework.support(cand, info)
        predicted = None if support else framework.predictable(cand, info)
        if support or predicted:
            result = checker.check(cand, fix)
            result.predicted = predicted
        else:
            result = CandidateCheck(cand, Status.UNSUPPORTED, support.reason, suggestion=support.suggestion)
        results.append(result)
        events({"event": "verdict", "check": result, "index": index, "count": len(cands)})
    return checker.result(results)
