"""`check`: does a policy train like fp32? Where does it break, and which fp32 islands fix it?

For every candidate, in any framework: a differential training run against a strict-fp32
reference (the backend's ``trajectory``, compared by :mod:`mixprec.numerics.compare`), per-layer
ranges under the candidate (the first non-finite layer forward and backward), a verdict against
per-policy thresholds scaled by the chaos floor (:mod:`mixprec.numerics.verdict`), and on request
a search for a small ``keep_fp32`` set that makes a failing candidate pass, verified by re-running
the check (:mod:`mixprec.numerics.fix`).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from mixprec import validation
from mixprec.budget import Budget
from mixprec.checking.config import TRAIN_STEPS, CheckConfig
from mixprec.errors import PolicyError, UsageError
from mixprec.events import Events, ignore
from mixprec.frameworks import Framework, framework_of
from mixprec.hardware.device import detect
from mixprec.hardware.formats import slow_formats
from mixprec.numerics.compare import Comparison, Trajectory, compare
from mixprec.numerics.fix import MapSpace, Trials, search_keep_fp32, search_precision_map
from mixprec.numerics.limits import LOW_PRECISION_FORMATS
from mixprec.numerics.ranges import RangeReport
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.numerics.trend import (
    BITS_FACTOR,
    Outlook,
    Prediction,
    least_headroom,
    outlook,
    predict,
    theil_sen,
)
from mixprec.numerics.verdict import (
    CHAOS_PERTURBATION,
    Floor,
    allowed_rel_loss_diff,
    default_thresholds,
    format_perturbation,
    judge,
)
from mixprec.policy import Candidate, Thresholds
from mixprec.policy.islands import is_fp32_island
from mixprec.policy.support import cures
from mixprec.status import Status

MAX_FIX_SET = 8  # the keep-fp32 search tries at most this many layers
# Half-precision updates lost across more than this share of all weights: no small set of fp32
# layers cures that (a stall concentrated in an embedding, say, is searched as usual).
WIDE_STALL = 0.5
SEARCH_STEPS = 4  # steps of each trial run of the search (the found set is verified over all)
# A fix for a predicted failure is verified past the predicted step: this much past it, at most
# this many steps.
VERIFY_MARGIN = 1.5
MAX_VERIFY_STEPS = 1000
# The run length verdicts are about when nobody names one (tune's --train-steps default too).
NEVER_RAN = "nothing was tested"
# The reference learns when its fitted fall over the checked steps is this many times the larger of
# the median distance of its losses from the fit (batch-to-batch noise) and the largest distance
# between two fp32 runs' losses (the chaos run: run-to-run spread).
LEARNING_MARGIN = 1.0
# Power first: where the reference does not learn over the steps asked for, the check runs it over
# twice as many, then twice again, up to this many times the steps asked and at most MAX_POWER_STEPS
# (and only what the budget can pay): the steps the verdicts need to mean something.
POWER_FACTOR = 4
MAX_POWER_STEPS = 64
# What an inconclusive verdict's reason starts with.
INCONCLUSIVE = "inconclusive"


def never_ran(cand: Candidate, traj: Trajectory) -> str:
    """Why the candidate's format never ran (a float64 model or default dtype, say), or ''."""
    expected = str(cand.spec.compute_dtype).removeprefix("torch.")
    if cand.emulate or traj.observed_dtype is None or traj.observed_dtype == expected:
        return ""
    return (
        f"{NEVER_RAN}: the first matmul/conv layer {traj.observed_layer!r} computed in "
        f"{traj.observed_dtype}, not {expected}, so {cand.label} never ran (a float64 model or "
        "torch.set_default_dtype(float64)? "
        "train the model in float32 to check a lower precision)"
    )


def stall_outlook(traj: Trajectory, limit: float, train_steps: int) -> str | None:
    """A growing share of half-precision updates lost to rounding, predicted to pass ``limit``
    within the run (torchtune#2254: pure-bf16 updates stall as weights grow against the LR)."""
    p = predict(traj.stalls, limit, layer="all weights", direction="updates", fmt="storage", start=1)
    if p is None or p.step is None or p.step > train_steps or not p.trending or not p.within_evidence:
        return None
    return (
        f"{traj.stalls[-1]:.1%} of the weight updates rounded away at the last checked step, growing: "
        f"predicted to pass {limit:.0%} at about step {p.step} of {train_steps} ({p.points} steps fitted, "
        f"R^2 {p.r2:.2f}); use the *-mixed policy"
    )


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
        train_steps: int = TRAIN_STEPS,
    ) -> None:
        self.train_steps = train_steps
        self._eager: dict[tuple[Candidate, int], Trajectory] = {}  # compiled candidates' eager twins
        self.workload, self.framework, self.device, self.steps = workload, framework, device, steps
        self.batch_size, self.thresholds, self.events, self.budget = batch_size, thresholds, events, budget
        self.asked_steps = steps
        started = time.perf_counter()
        self.fp32_runs(steps)
        self.reference_ranges = framework.layer_ranges(
            workload, framework.baseline, self.batches[0], device, None
        )
        self.power = self.power_first(steps, time.perf_counter() - started)
        self.learning = not_learning(self.reference.losses, run_spread(self.reference, self.chaos))

    def fp32_runs(self, steps: int) -> None:
        """The strict-fp32 reference and the chaos run over ``steps`` steps, and the chaos floor."""
        workload, framework, device = self.workload, self.framework, self.device
        self.steps = steps
        self.batches = framework.make_batches(workload, self.batch_size, device, 0, steps)
        baseline = framework.baseline
        self.stage("fp32 reference" + (f" over {steps} steps" if steps != self.asked_steps else ""))
        self.reference = framework.trajectory(workload, baseline, self.batches, steps, device)
        broken = broken_reference(self.reference)
        if broken:
            # The user's bug, not a precision verdict: no candidate can be judged against it.
            raise UsageError(
                f"the workload itself fails in strict fp32: {broken}; no policy can be judged against "
                f"it. Fix {getattr(workload, 'name', 'it')!r} so it trains in fp32 first (mixprec --debug "
                "shows where)."
            )
        self._apart: dict[str, Trajectory] = {}  # fp32 runs a half format's rounding apart, by format
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

    def power_first(self, steps: int, took_s: float) -> str:
        """Before judging: does the fp32 reference learn over the compared steps, beyond its
        batch-to-batch noise and its run-to-run spread? Where not, run it (and the chaos run) over
        twice the steps, then twice again, up to ``POWER_FACTOR`` times the steps asked (at most
        ``MAX_POWER_STEPS``) while the budget can pay: the reference and chaos runs again, plus each
        candidate's longer run. What was done, in words ('' when the steps asked for were enough)."""
        limit = max(steps, min(POWER_FACTOR * steps, MAX_POWER_STEPS))
        why = not_learning(self.reference.losses, run_spread(self.reference, self.chaos))
        tried = steps
        while why and self.steps < limit:
            more = min(2 * self.steps, limit)
            per_step = took_s / (2 * self.steps)  # one fp32 run's step, from the runs so far
            if not self.budget.can_pay(per_step * more * 4):  # reference, chaos, two candidates
                return (
                    f"the fp32 reference did not learn over {self.steps} steps; the budget could not pay "
                    f"for {more}"
                )
            started = time.perf_counter()
            before = (self.steps, self.batches, self.reference, self.chaos, self.floor)
            try:
                self.fp32_runs(more)
            except UsageError as exc:  # fp32 itself fails further on: judge over the steps that ran
                self.steps, self.batches, self.reference, self.chaos, self.floor = before
                return (
                    f"the fp32 reference did not learn over {tried} steps; over {more} it failed itself "
                    f"({str(exc).split(';')[0].removeprefix('the workload itself fails in strict fp32: ')}), "
                    f"so the candidates are judged over {self.steps}"
                )
            took_s = time.perf_counter() - started
            why = not_learning(self.reference.losses, run_spread(self.reference, self.chaos))
        if self.steps == tried:
            return ""
        if why:
            return (
                f"the fp32 reference did not learn over {tried} steps; checked {self.steps} steps "
                f"({POWER_FACTOR}x at most): it does not learn over those either"
            )
        losses = self.reference.losses
        return (
            f"the fp32 reference did not learn over {tried} steps; checked {self.steps} steps, over which "
            f"it learns (loss {losses[0]:.4g} -> {losses[-1]:.4g}, beyond its run-to-run spread of "
            f"{run_spread(self.reference, self.chaos):.3g})"
        )

    def stage(self, text: str) -> None:
        self.events({"event": "stage", "text": f"checking {text}"})

    def run(
        self,
        cand: Candidate,
        keep_fp32: Sequence[str] = (),
        steps: int | None = None,
        keep_bf16: Sequence[str] = (),
    ) -> tuple[bool, str, Comparison, Trajectory]:
        """Train ``cand`` (with ``keep_fp32`` and the precision map ``keep_bf16`` added) ``steps``
        steps next to the reference; the verdict over those steps and, from their trends, over the
        run (``train_steps``)."""
        steps = steps or self.steps
        trial = replace(
            cand, keep_fp32=(*cand.keep_fp32, *keep_fp32), keep_bf16=(*cand.keep_bf16, *keep_bf16)
        )
        traj = self.framework.trajectory(self.workload, trial, self.batches, steps, self.device)
        if self.reference.dropped_imaginary:  # the model's own cast, in fp32 as well: not the candidate's
            traj.dropped_imaginary = None
        ref = replace(self.reference, losses=self.reference.losses[:steps])
        cmp = compare(ref, traj)
        floor = self.loss_floor(cand, steps)
        untested = never_ran(cand, traj)
        if untested:
            return False, untested, cmp, traj
        passed, reason = judge(
            cmp, traj, self.thresholds[cand.threshold_key], steps, floor, rounding_format(cand)
        )
        if passed:
            risk = self.risk(cand, self.ranged(trial, traj, steps), keep_fp32)
            if risk is not None:
                return False, risk, cmp, traj
        return passed, reason, cmp, traj

    def floor_run_needed(self, cand: Candidate) -> bool:
        """Whether judging ``cand`` still takes an fp32 run of its own: the one a rounding of its
        half format apart, made once per format (:meth:`loss_floor`)."""
        fmt = rounding_format(cand)
        return format_perturbation(fmt) is not None and fmt not in self._apart

    def loss_floor(self, cand: Candidate, steps: int) -> Floor:
        """What ``cand``'s loss is judged against over ``steps``: how far the 2^-20 chaos run drifts
        from the reference, or, for a half format, how far an fp32 run whose weights are off by one
        rounding to it drifts, where that is further (the run made once per format)."""
        ref = replace(self.reference, losses=self.reference.losses[:steps])
        drift = compare(ref, replace(self.chaos, losses=self.chaos.losses[:steps])).max_rel_loss_diff
        floor = replace(self.floor, rel_loss_diff=drift)
        fmt = rounding_format(cand)
        perturb = format_perturbation(fmt)
        if perturb is None:
            return floor
        if fmt not in self._apart:
            self.stage(f"fp32 run whose weights are one {fmt} rounding apart")
            self._apart[fmt] = self.framework.trajectory(
                self.workload, self.framework.baseline, self.batches, self.steps, self.device, perturb=perturb
            )
        run = self._apart[fmt]
        own = compare(ref, replace(run, losses=run.losses[:steps])).max_rel_loss_diff
        if run.error or not math.isfinite(own) or own <= drift:
            return floor
        return replace(floor, rel_loss_diff=own, apart=f"whose weights differ by one {fmt} rounding")

    def ranged(self, trial: Candidate, traj: Trajectory, steps: int) -> Trajectory:
        """``traj``, or for a compiled candidate (whose graph range hooks would change) its eager
        twin's run: the formats it rounds to are the same, so are the trends of its ranges."""
        if traj.series or not trial.compile:
            return traj
        eager = replace(trial, compile=None, compile_scope=None)
        if (eager, steps) not in self._eager:
            self._eager[(eager, steps)] = self.framework.trajectory(
                self.workload, eager, self.batches, steps, self.device
            )
        return self._eager[(eager, steps)]

    def outlook(self, cand: Candidate, traj: Trajectory, keep_fp32: Sequence[str] = ()) -> Outlook:
        """What ``traj``'s ranges predict over ``train_steps`` in the candidate's range format; fp32
        islands compute in fp32, so their own ranges do not count."""
        islands = (*cand.keep_fp32, *keep_fp32)
        series = [s for s in traj.series if not is_fp32_island(s.name, islands)]
        # from the second step: the first step's values are the initial weights' (the check starts at
        # the loss scale GradScaler settles on, so no start-up back-off is in the series)
        return outlook(series, range_format(cand), self.train_steps, start=1)

    def risk(self, cand: Candidate, traj: Trajectory, keep_fp32: Sequence[str] = ()) -> str | None:
        """Why the run the user will do is predicted to fail where the checked steps passed: a layer
        predicted to overflow, or half-precision updates predicted to stall; None otherwise."""
        seen = self.outlook(cand, traj, keep_fp32).at_risk
        if seen is not None:
            return f"at risk: {seen.describe(self.train_steps)}"
        stall = stall_outlook(
            traj, self.thresholds[cand.threshold_key].max_stalled_update_fraction, self.train_steps
        )
        if stall is not None:
            return f"at risk: {stall}"
        return None

    def check(self, cand: Candidate, fix: bool) -> CandidateCheck:
        self.stage(cand.label)
        passed, reason, cmp, traj = self.run(cand)
        thr = self.thresholds[cand.threshold_key]
        fmt = rounding_format(cand)
        floor = self.loss_floor(cand, self.steps)  # made by run(): no new run here
        ranged = self.ranged(cand, traj, self.steps)  # a compiled candidate's ranges: its eager twin's
        seen = self.outlook(cand, ranged)
        verdict = Status.PASS if passed else Status.AT_RISK if reason.startswith("at risk") else Status.FAIL
        if not passed and reason.startswith(NEVER_RAN):
            verdict = Status.ERROR
        result = CandidateCheck(
            candidate=cand,
            verdict=verdict,
            reason=reason,
            max_rel_loss_diff=cmp.max_rel_loss_diff,
            output_sqnr_db=cmp.output_sqnr_db,
            min_grad_sqnr_db=cmp.min_grad_sqnr_db,
            median_grad_sqnr_db=cmp.median_grad_sqnr_db,
            total_grad_sqnr_db=cmp.total_grad_sqnr_db,
            skipped_steps=cmp.skipped_steps,
            scaler_warmup_skips=traj.warmup_skips,
            stalled_update_fraction=traj.stalled_update_fraction,
            allowed_rel_loss_diff=allowed_rel_loss_diff(thr, floor.rel_loss_diff),
            required_output_sqnr_db=self.floor.required(
                thr.min_output_sqnr_db, self.floor.output_sqnr_db, fmt
            ),
            required_grad_sqnr_db=self.floor.required(thr.min_grad_sqnr_db, self.floor.grad_sqnr_db, fmt),
            losses=traj.losses,
            rel_loss_diff=cmp.rel_loss_diff,
            scales=traj.scales,
            worst_grads=sorted(cmp.grad_sqnr_db.items(), key=lambda kv: kv[1])[:5],
            thresholds=asdict(thr),
            series=[s.to_dict() for s in ranged.series],
            run_headroom=least_headroom(ranged.series, range_format(cand)),
            stalls=list(traj.stalls),
            outlook=seen.to_dict(),
            train_steps=self.train_steps,
            evidence=self.evidence(cand, ranged, seen),
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
        census = None
        if cand.spec.low_format is not None:
            try:
                census = self.framework.linear_census(
                    self.workload, cand.spec, self.batches[0], self.device, cand.keep_fp32
                )
            except Exception as exc:  # evidence, as the ranges: its failure must not hide the verdict
                result.fix_note = f"Linear census unavailable: {type(exc).__name__}: {exc}"
            else:
                untested = no_low_gemm(cand, census)
                if untested:  # a run without the format is bf16-mixed's: no verdict on the format
                    passed, verdict = False, Status.ERROR
                    result.verdict, result.reason = verdict, untested
        if not passed and verdict != Status.ERROR:
            result.suggestion = self.suggest(cand, result, rfmt)
            if result.first_nonfinite_forward and "non-finite" in reason:
                result.reason += f"; first non-finite output in {result.first_nonfinite_forward!r}"
            if fix and cand.spec.is_math_mode:
                result.fix_note = (
                    f"{cand.label} is a global fp32 math mode (no autocast): fp32 islands cannot fix it; "
                    "use fp32 or a *-mixed policy"
                )
            elif fix and (result.stalled_update_fraction or 0.0) > WIDE_STALL:
                result.fix_note = (
                    f"keep_fp32 search skipped: {result.stalled_update_fraction:.0%} of all weight updates "
                    "rounded away, too many for a few fp32 layers to cure; use the *-mixed policy"
                )
            elif fix and self.budget.expired():
                result.fix_note = "keep_fp32 search skipped: time budget spent"
            elif fix and census is not None and census.shapes:
                self.search_map(cand, result, census, seen.at_risk)
            elif fix:
                self.search_fix(cand, result, rfmt, seen.at_risk)
        if census is not None:
            result.precision_map = map_report(cand, census, result.fix_keep_bf16)
        spread = floor.rel_loss_diff
        if cmp.max_rel_loss_diff is not None and math.isfinite(cmp.max_rel_loss_diff):
            result.spread_ratio = cmp.max_rel_loss_diff / spread if spread > 0 else None
            result.randomness = against_spread(cmp.max_rel_loss_diff, spread, floor.apart)
        if result.verdict == Status.PASS and result.randomness:
            result.reason += f"; {result.randomness}"
        if result.verdict == Status.PASS and self.learning:
            # no failure seen, but two runs that do not learn cannot show one: never a pass
            result.verdict = Status.INCONCLUSIVE
            result.reason = f"{INCONCLUSIVE}: {self.learning} (its figures: {result.reason})"
        return result

    def evidence(self, cand: Candidate, traj: Trajectory, seen: Outlook) -> str:
        """What the verdict cannot see: a trend whose crossing lies beyond the evidence's horizon."""
        far = seen.unsure
        if far is None or seen.at_risk is not None:
            return ""
        return (
            f"not enough evidence: {far.describe(self.train_steps)}; {len(traj.losses)} checked steps "
            f"support a crossing at most {far.horizon} steps and {BITS_FACTOR:g}x the "
            f"{max(far.gained_bits, 0.0):.1f} bits they grew away; rerun with --steps {far.steps_needed()}"
        )

    def suggest(self, cand: Candidate, result: CandidateCheck, fmt: str) -> str:
        overflow = (
            result.first_nonfinite_forward
            or result.first_nonfinite_backward
            or result.skipped_steps
            or result.verdict == Status.AT_RISK
        )
        if cand.spec.low_format is not None:
            # its rounding is the Linear GEMMs' own: the cure is fewer of them in the format
            return (
                f"keep the Linear layers {cand.spec.low_format} loses most in bf16 (check --fix searches the "
                "precision map), or use bf16-mixed"
            )
        # only what this device runs natively is advice (a CPU has no tf32, and fp16 is slow there)
        info = detect(self.device)
        if fmt == "fp16" and overflow:
            options = cures(cand.policy, "range", info, fmt)
            if options:
                return f"fp16 overflows here: try {' or '.join(options[:2])} (fp32's range)"
        elif fmt == "bf16":
            options = cures(cand.policy, "precision", info, fmt)
            if options:
                return f"bf16 loses too much precision here: try {' or '.join(options[:2])}"
        return "keep the failing layers in fp32 (keep_fp32=[...]) or use fp32"

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

    def search_fix(self, cand: Candidate, result: CandidateCheck, fmt: str, risk: Prediction | None) -> None:
        """Grow a keep_fp32 set from the evidence until the candidate passes, then shrink it; a
        predicted overflow's layer is evidence like an observed one, and the fix is verified over a
        run long enough to pass the predicted step."""
        order = self.search_space(result, fmt)
        verify = self.steps
        if risk is not None:
            order = [risk.layer, *(n for n in order if n != risk.layer)]
            verify = max(self.steps, min(MAX_VERIFY_STEPS, int(VERIFY_MARGIN * ((risk.step or 0) + 1))))
        search_keep_fp32(
            self.run, cand, result, order, MAX_FIX_SET, self.trials(verify, risk), self.framework.island_kind
        )

    def search_map(
        self, cand: Candidate, result: CandidateCheck, census: Any, risk: Prediction | None
    ) -> None:
        """The precision map of a low-format candidate (fp8, mxfp8, nvfp4): the smallest set of
        Linear GEMMs kept in bf16 that passes, from the field's rules (first and last Linear, the LM
        head), the layers whose operands the format quantises worst first; verified like a
        keep_fp32 fix (past a predicted failure's step)."""
        layers = list(census.shapes)  # execution order
        _, owners = self.framework.island_names(self.workload)
        # observed evidence first (a predicted overflow's layer, the first non-finite layers, the
        # owners of the worst gradients), then the census: the worst quantised GEMMs
        suspects: list[str | None] = [risk.layer] if risk is not None else []
        suspects += [result.first_nonfinite_forward, result.first_nonfinite_backward]
        suspects += [owners.get(pname) for pname, _ in result.worst_grads]
        suspects += sorted(layers, key=lambda n: census.sqnr_db.get(n, math.inf))
        ordered = [n for n in dict.fromkeys(suspects) if n is not None and n in census.shapes]
        verify = self.steps
        if risk is not None:
            verify = max(self.steps, min(MAX_VERIFY_STEPS, int(VERIFY_MARGIN * ((risk.step or 0) + 1))))
        space = MapSpace(
            layers=layers,
            rules=field_rules(self.workload, layers),
            suspects=ordered,
            directions=("wgrad", "dgrad", "forward") if cand.spec.block_format else (),
            present=census.directions or {},
        )
        search_precision_map(
            lambda entries, steps: self.run(cand, (), steps, entries),
            cand,
            result,
            space,
            self.trials(verify, risk),
        )

    def trials(self, verify: int, risk: Prediction | None) -> Trials:
        """A fix search's trials: as long as the check where a failure is predicted late in the run
        (a shorter trial cannot see it), else ``SEARCH_STEPS`` at most; verified over ``verify``."""
        search_steps = self.steps if risk is not None else min(self.steps, SEARCH_STEPS)
        return Trials(steps=verify, search_steps=search_steps, budget=self.budget, stage=self.stage)

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
            format_floor_losses={fmt: run.losses for fmt, run in self._apart.items() if not run.error},
            candidates=results,
            reference_layers=layer_headroom(self.reference_ranges),
            reference_note="; ".join(filter(None, [self.reference.note, self.learning])),
            learns=not self.learning,
            asked_steps=self.asked_steps,
            power=self.power,
        )


def no_low_gemm(cand: Candidate, census: Any) -> str:
    """Why a low-format candidate tested nothing of its format (no Linear it can take ran, or its
    map keeps them all in bf16), or ''."""
    fmt = cand.spec.low_format
    if not census.shapes:
        return (
            f"{NEVER_RAN}: no Linear of the model that {fmt} can take ran (dimensions multiples of its "
            "block, fp32 weights); the run was bf16 autocast alone"
        )
    if not any(x["low_directions"] for x in map_report(cand, census, ())["layers"]):
        return (
            f"{NEVER_RAN}: keep_bf16={list(cand.keep_bf16)} keeps every Linear {fmt} can take in bf16; "
            "the run was bf16 autocast alone"
        )
    return ""


def field_rules(workload: Any, layers: Sequence[str]) -> list[str]:
    """The layers every low-format recipe in the field keeps in bf16 by a fixed rule (Accelerate's
    torchao backend, Megatron's ``--first-last-layers-bf16``, torchtitan's NVFP4 recipe): the first
    and the last Linear to run, and an LM head (a Linear whose weight an embedding shares)."""
    from torch import nn  # the low formats are torch's: only a torch workload gets here

    rules = [*layers[:1], *layers[-1:]]
    model = getattr(workload, "model", None)
    if model is not None:
        embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        modules = dict(model.named_modules())
        rules += [n for n in layers if id(getattr(modules.get(n), "weight", None)) in embedded]
    return list(dict.fromkeys(rules))


def map_report(cand: Candidate, census: Any, keep_bf16: Sequence[str]) -> dict[str, Any]:
    """The precision map's facts for the report: per Linear its GEMM shapes, operand SQNR in the
    format, the roofline's predicted speedup on the format's GPU (a prediction, labelled so), and
    the share of the step's FLOPs in the format whole-model and under the map ``keep_bf16``."""
    from mixprec.hardware.roofline import DEFAULT_GPU, estimate
    from mixprec.policy.lowformat import low_directions

    fmt = str(cand.spec.low_format)
    whole = dict(census.directions)
    entries = (*cand.keep_bf16, *keep_bf16)
    mapped = {n: low for n, runs in whole.items() if (low := low_directions(n, entries, runs))}
    layers = []
    for name, (m, k, n) in census.shapes.items():
        speed = estimate(m, k, n, fmt)
        layers.append(
            {
                "name": name,
                "m": m,
                "k": k,
                "n": n,
                "operand_sqnr_db": census.sqnr_db.get(name),
                "predicted_speedup": speed.speedup,
                "low_directions": sorted(mapped.get(name, ())),
            }
        )
    return {
        "format": fmt,
        "gpu": DEFAULT_GPU[fmt],
        "speedup_is": "a roofline prediction from the shapes (mixprec.hardware.roofline), not measured",
        "layers": layers,
        "low_share_whole": census.low_share(whole),
        "low_share_mapped": census.low_share(mapped),
        "map": [*cand.keep_bf16, *keep_bf16],
        "step_flops": census.step_flops,
        "no_gain": [x["name"] for x in layers if x["predicted_speedup"] < 1.0 and x["low_directions"]],
    }


def cured(rejected: CandidateCheck, rescued: CandidateCheck) -> str:
    """Why keeping layers in fp32 cured what rejected the candidate, in the figures both checks
    measured: the layer the rejection named, stalled updates, skipped steps, loss and SQNR."""
    added = [n for n in rescued.candidate.keep_fp32 if n not in rejected.candidate.keep_fp32]
    risk = (rejected.outlook or {}).get("at_risk") or {}
    named = risk.get("layer") or rejected.first_nonfinite_forward or rejected.first_nonfinite_backward
    changes = []
    if named and is_fp32_island(named, added):
        changes.append(f"{named!r}, which the rejection named, now computes in fp32")
    figures = (
        ("stalled updates", "stalled_update_fraction", lambda v: f"{v:.1%}"),
        ("skipped steps", "skipped_steps", str),
        ("max loss diff", "max_rel_loss_diff", lambda v: f"{v:.2%}"),
        ("gradient SQNR", "total_grad_sqnr_db", lambda v: f"{v:.1f} dB"),
    )
    for name, key, fmt in figures:
        before, after = getattr(rejected, key), getattr(rescued, key)
        if before is not None and after is not None and fmt(before) != fmt(after):
            changes.append(f"{name} {fmt(before)} -> {fmt(after)}")
    return (
        f"rescued: {rejected.label} was {rejected.verdict} ({rejected.reason}); with "
        f"{', '.join(added)} kept in fp32: {'; '.join(changes) or 'the same figures'}; {rescued.reason}"
    )


def run_spread(reference: Trajectory, chaos: Trajectory) -> float:
    """How far two strict-fp32 runs' losses lie apart over the same steps (the reference and the
    chaos run, whose weights differ by 2^-20): the run-to-run spread, in loss units."""
    pairs = [(a, b) for a, b in zip(reference.losses, chaos.losses, strict=False) if math.isfinite(a + b)]
    return max((abs(a - b) for a, b in pairs), default=0.0)


def not_learning(losses: Sequence[float], spread: float = 0.0) -> str:
    """Why the verdicts have no power when the fp32 reference's loss does not fall over the checked
    steps by more than its batch-to-batch noise (the median distance from its Theil-Sen fit) and its
    run-to-run ``spread`` (random labels, a learning rate of 0 or far too high): two runs that do
    not learn drift apart like chaos, and the chaos floor they set lets anything through; a
    candidate is then inconclusive, never a pass. '' when it learns."""
    points = [(t, v) for t, v in enumerate(losses) if math.isfinite(v)]
    if len(points) < 4:
        return ""
    ts, values = [float(t) for t, _ in points], [v for _, v in points]
    slope, intercept = theil_sen(ts, values)
    noise = statistics.median(abs(v - (intercept + slope * t)) for t, v in points)
    fall = -slope * (ts[-1] - ts[0])
    if fall > LEARNING_MARGIN * max(noise, spread):  # a fall neither noise nor chaos can make
        return ""
    beyond = f", a fall within its run-to-run spread of {spread:.3g}" if spread > noise and fall > 0 else ""
    return (
        f"the fp32 reference did not learn over the {len(losses)} checked steps (loss {losses[0]:.4g} "
        f"-> {losses[-1]:.4g}, trend {slope:+.3g}/step{beyond}): the "
        "verdicts compare runs that do not learn and have little power. Make it learn: data its "
        "model can learn (real data, or labels from a fixed teacher, not random ones), a learning "
        "rate scaled to the batch (linearly for SGD, by its square root for Adam, with a warm-up), "
        "or more checked steps (`check --steps`, `tune --check-steps`)"
    )


def against_spread(diff: float, spread: float, apart: str = Floor.apart) -> str:
    """A candidate's largest loss difference against fp32's own run-to-run spread on the same
    steps (two fp32 runs ``apart``): "within training randomness" where it is inside it
    (DeepSeek-V3's wording for FP8 against BF16), else how many times it."""
    if spread <= 0:
        return f"{_pct(diff)} apart; two fp32 runs do not drift apart at all here"
    of = f"fp32's own run-to-run spread of {_pct(spread)} (two runs {apart})"
    if diff <= spread:
        return f"within training randomness: {_pct(diff)} against {of}"
    return f"{diff / spread:.3g}x {of}"


def _pct(x: float) -> str:
    """A relative difference with the digits it needs: '1.3%', '0.0021%', '0%'."""
    return f"{100 * x:.2g}%" if x else "0%"


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
    config: CheckConfig | None = None,
    *,
    events: Events | None = None,
    budget: Budget | None = None,
) -> Checker:
    """Run the fp32 reference, its per-layer ranges and the chaos floor once, for many checks
    (``config``'s steps, batch size, device, thresholds and run length)."""
    config = config or CheckConfig()
    framework = framework_of(workload)
    dev = framework.resolve_device(config.device)
    events = events or ignore
    bs = config.batch_size or framework.default_batch_size(workload)
    events({"event": "stage", "text": "checking the workload: one strict-fp32 step"})
    framework.validate_workload(workload, dev, bs, budget=budget)
    bs = config.batch_size or framework.default_batch_size(workload)  # a script's is known only now
    merged = {**default_thresholds(), **(config.thresholds or {})}
    return Checker(
        workload,
        framework,
        dev,
        bs,
        config.steps,
        merged,
        events,
        budget or Budget.unlimited(),
        config.train_steps,
    )


def candidates_of(
    framework: Framework, policies: str | Sequence[str | Candidate], emulate: Sequence[str]
) -> list[Candidate]:
    """The candidates ``policies`` (names, a comma-separated string of them, or Candidates) and
    ``emulate`` (formats) name, validated."""
    if isinstance(policies, str):  # 'bf16-mixed,fp16-mixed', as bench takes it (not its characters)
        policies = [p.strip() for p in policies.split(",") if p.strip()]
    cands = [p if isinstance(p, Candidate) else Candidate(p, framework=framework.name) for p in policies] + [
        Candidate("fp32", emulate=fmt, framework=framework.name) for fmt in emulate
    ]
    return [framework.validate(c) for c in cands]


def check_islands(framework: Framework, workload: Any, cands: Sequence[Candidate]) -> None:
    """Every keep_fp32 pattern must match a module (or layer): a pattern that matches nothing keeps
    nothing in fp32, and a check of it would pass a policy the user did not ask for."""
    names, _ = framework.island_names(workload)
    if not names:  # the backend cannot list them (yet): nothing to hold the patterns against
        return
    for cand in cands:
        for pattern in cand.keep_fp32:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                continue
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.4)
            hint = f"closest: {', '.join(repr(n) for n in close)}" if close else f"e.g. {names[:3]!r}"
            raise PolicyError(
                f"keep_fp32 pattern {pattern!r} of {cand.label} matches no module of "
                f"{framework.workload_label(workload)} ({hint}); patterns are fnmatch patterns over "
                "the model's module names (model.named_modules()): fix or drop it."
            )
        refuse_split_tie(workload, cand)
        if cand.keep_bf16 and getattr(workload, "model", None) is not None:
            from mixprec.policy.lowformat import refuse_unmatched

            try:  # a map entry that names no Linear keeps nothing in bf16: refused as keep_fp32's
                refuse_unmatched(workload.model, cand.keep_bf16)
            except PolicyError as exc:
                raise PolicyError(f"{cand.label}: {exc}") from None


def refuse_split_tie(workload: Any, cand: Candidate) -> None:
    """A *-true candidate whose keep_fp32 keeps one side of a tied weight in fp32 (an LM head tied to
    its embedding) is refused up front with the reason ``Policy.prepare`` gives
    (:func:`mixprec.policy.hooks.refuse_split_ties`): its check could only crash."""
    from torch import nn

    from mixprec.policy.hooks import refuse_split_ties
    from mixprec.policy.islands import island_names

    model = getattr(workload, "model", None)
    if not cand.keep_fp32 or not isinstance(model, nn.Module) or cand.spec.param_dtype is None:
        return  # another framework's model, no islands, or fp32 master weights: nothing to split
    modules = dict(model.named_modules())
    try:
        refuse_split_ties(model, {name: modules[name] for name in island_names(model, cand.keep_fp32)})
    except ValueError as exc:
        raise PolicyError(f"{cand.label}: {exc}") from None


def check(
    workload: Any,
    config: CheckConfig | None = None,
    *,
    events: Events | None = None,
    budget: Budget | None = None,
    checker: Checker | None = None,
    **fields: Any,
) -> CheckResult:
    """Check each policy (and each emulated format) against a strict-fp32 reference on ``workload``
    (a :class:`mixprec.Workload` or another framework's, e.g. ``mixprec.keras.KerasWorkload``).

    ``config``: a :class:`CheckConfig`; ``fields`` replace its fields
    (``check(workload, policies="bf16-mixed", steps=12, fix=True)``), each described there. Its
    ``train_steps`` is the length of the run the verdicts are about: every layer's ranges are
    recorded at every checked step, and a trend predicted to overflow the candidate's format (or to
    stall its updates) within that many steps makes the candidate ``at-risk``, with the layer and the
    step; a trend beyond what the checked steps support is reported as "not enough evidence", with
    the ``steps`` that would reach it. ``budget`` stops keep-fp32 searches once spent. ``checker``
    (from :func:`make_checker`) reuses an fp32 reference, its ranges and the chaos floor across
    calls, e.g. when candidates are checked one at a time. ``events`` receives 'stage' events and
    a ``{"event": "verdict", "check": CandidateCheck, "index": i, "count": n}`` as each candidate is
    judged. The workload is validated first (one strict-fp32 step).
    """
    config = validation.with_fields(config or CheckConfig(), fields, "check")
    policies, emulate, fix = config.policies, config.emulate, config.fix
    alone = checker is None  # not one check of many (tune's): the source's own candidates too
    if checker is None:
        framework = framework_of(workload)
        cands = candidates_of(framework, policies, emulate)  # bad names fail before the reference runs
        check_islands(framework, workload, cands)
        checker = make_checker(workload, config, events=events, budget=budget)
    else:
        cands = candidates_of(checker.framework, policies, emulate)
    framework, events = checker.framework, events or checker.events
    if alone:  # a script as written, checked beside what was asked
        cands += [c for c in framework.source_candidates(checker.workload) if c not in cands]
    check_islands(framework, checker.workload, cands)  # again: Keras lists its layers once built
    info = detect(checker.device)
    if alone and info.type == "cpu":  # a format slow here, said before its check runs for minutes
        formats = {c.policy: c.spec.peak_key for c in cands if not c.emulate and framework.support(c, info)}
        for warning in slow_formats(formats, info, conv=framework.has_convolutions(checker.workload)):
            events({"event": "note", "text": f"warning: {warning}"})
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
