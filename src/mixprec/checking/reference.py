"""The strict-fp32 reference and chaos run a check judges against (power first: more steps while
the reference does not learn), and one candidate's run beside it: compared
(:mod:`mixprec.numerics.compare`), judged (:mod:`mixprec.numerics.verdict`) and its trends predicted."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mixprec import clock
from mixprec.budget import Budget
from mixprec.checking.config import TRAIN_STEPS_SETTING, CheckConfig
from mixprec.errors import UsageError
from mixprec.events import Events
from mixprec.frameworks import Framework
from mixprec.numerics.compare import Comparison, Trajectory, compare
from mixprec.numerics.trend import Outlook, falling_p_value, outlook, predict, run_of, theil_sen
from mixprec.numerics.verdict import CHAOS_PERTURBATION, Floor, default_thresholds, format_perturbation, judge
from mixprec.policy import Candidate
from mixprec.policy.islands import is_fp32_island

# What a reason starts with when the candidate's format never ran (no verdict on it).
NEVER_RAN = "nothing was tested"
# The reference learns when Kendall's one-sided trend test says its loss falls at this level (the
# chance that a reference with nothing to learn is called learning: calibrated on references fed
# random labels in tests/checking/test_reference_learns.py) and the fall is beyond the run-to-run
# spread of two fp32 runs (the chaos run), which a comparison could not tell from the candidate.
LEARNING_ALPHA = 0.05
# More steps are worth buying unless the loss shows no sign of falling: a rising or flat reference
# (its trend test above this) does not learn in 4x the steps either, and the runs would spend the
# budget to show it. Lenient on purpose: 4 noisy steps early in training (the zoo MLP's 2.321,
# 2.294, 2.295, 2.302: p = 0.62) learn over 16, and the share below bounds what a wrong guess costs.
MAY_LEARN_P = 0.75
# The longer fp32 runs may take at most this share of the budget left: the rest checks candidates.
POWER_SHARE = 1 / 3
# Power first: where the reference does not learn over the steps asked for, the check runs it over
# twice as many, then twice again, up to this many times the steps asked and at most MAX_POWER_STEPS
# (and only what the budget can pay): the steps the verdicts need to mean something.
POWER_FACTOR = 4
MAX_POWER_STEPS = 64


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
    run = run_of(train_steps, TRAIN_STEPS_SETTING)
    return (
        f"{traj.stalls[-1]:.1%} of the weight updates rounded away at the last checked step, growing: "
        f"predicted to pass {limit:.0%} at about step {p.step} of {run} ({p.points} steps fitted, "
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


def run_spread(reference: Trajectory, chaos: Trajectory) -> float:
    """How far two strict-fp32 runs' losses lie apart over the same steps (the reference and the
    chaos run, whose weights differ by 2^-20): the run-to-run spread, in loss units."""
    pairs = [(a, b) for a, b in zip(reference.losses, chaos.losses, strict=False) if math.isfinite(a + b)]
    return max((abs(a - b) for a, b in pairs), default=0.0)


def not_learning(losses: Sequence[float], spread: float = 0.0) -> str:
    """Why the verdicts have no power when the fp32 reference's loss does not fall over the checked
    steps: Kendall's trend test does not say it falls (at ``LEARNING_ALPHA``), or its fall is within
    the run-to-run ``spread`` (random labels, a learning rate of 0 or far too high). Two runs that
    do not learn drift apart like chaos, so a comparison of their losses cannot pass a candidate
    (only a gap past the chaos floor's allowance still fails it): it is inconclusive. '' when it
    learns."""
    values = [v for v in losses if math.isfinite(v)]
    if len(values) < 4:
        return ""
    p = falling_p_value(values)
    slope, _ = theil_sen([float(t) for t in range(len(values))], values)
    fall = -slope * (len(values) - 1)
    if p < LEARNING_ALPHA and fall > spread:
        return ""
    why = (
        f"a fall within its run-to-run spread of {spread:.3g}"
        if p < LEARNING_ALPHA
        else f"trend test p = {p:.2g}, learning needs < {LEARNING_ALPHA}"
    )
    return (
        f"the fp32 reference did not learn over the {len(losses)} checked steps (loss {losses[0]:.4g} "
        f"-> {losses[-1]:.4g}, {why}): the "
        "verdicts compare runs that do not learn and have little power. Make it learn: data its "
        "model can learn (real data, or labels from a fixed teacher, not random ones), a learning "
        "rate scaled to the batch (linearly for SGD, by its square root for Adam, with a warm-up), "
        "or more checked steps (`check --steps`, `tune --check-steps`)"
    )


def may_learn(losses: Sequence[float]) -> bool:
    """Whether more steps could show the reference learning: its loss shows some sign of falling."""
    values = [v for v in losses if math.isfinite(v)]
    fell = any(b < a for i, a in enumerate(values) for b in values[i + 1 :])
    return fell and falling_p_value(values) < MAY_LEARN_P


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


class Reference:
    """What every candidate of one workload shares: its backend, batches, the strict-fp32
    reference run, its per-layer ranges and the chaos floor; and one candidate's run judged
    against them."""

    def __init__(
        self,
        workload: Any,
        framework: Framework,
        device: str,
        batch_size: int,
        config: CheckConfig,
        events: Events,
        budget: Budget | None,
    ) -> None:
        """The runs over ``config``'s steps, judged with its thresholds (over the defaults) and
        predicted over its ``train_steps``."""
        steps, self.train_steps = config.steps, config.train_steps
        self.thresholds = {**default_thresholds(), **(config.thresholds or {})}
        # eager runs with their ranges, per (candidate, steps): a compiled twin's ranges are theirs
        self._eager: dict[tuple[Candidate, int], Trajectory] = {}
        self.workload, self.framework, self.device, self.steps = workload, framework, device, steps
        self.batch_size, self.events, self.budget = batch_size, events, budget or Budget.unlimited()
        self.asked_steps = steps
        started = clock.now()
        self.fp32_runs(steps)
        self.reference_ranges = framework.layer_ranges(
            workload, framework.baseline, self.batches[0], device, None
        )
        self.power = self.power_first(steps, clock.now() - started)
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
        """Before judging: does the fp32 reference learn over the compared steps (:func:`not_learning`)?
        Where not, and its loss shows a sign of falling (:func:`may_learn`), run it (and the chaos run) over
        twice the steps, then twice again, up to ``POWER_FACTOR`` times the steps asked (at most
        ``MAX_POWER_STEPS``) while the budget can pay: the reference and chaos runs again, plus each
        candidate's longer run. What was done, in words ('' when the steps asked for were enough)."""
        limit = max(steps, min(POWER_FACTOR * steps, MAX_POWER_STEPS))
        why = not_learning(self.reference.losses, run_spread(self.reference, self.chaos))
        tried = steps
        if why and self.steps < limit and not may_learn(self.reference.losses):
            p = falling_p_value([v for v in self.reference.losses if math.isfinite(v)])
            return (
                f"the fp32 reference did not learn over {self.steps} steps and shows no sign of falling "
                f"(trend test p = {p:.2g}): more steps were not run, they would not buy power"
            )
        while why and self.steps < limit and may_learn(self.reference.losses):
            more = min(2 * self.steps, limit)
            per_step = took_s / (2 * self.steps)  # one fp32 run's step, from the runs so far
            cost = per_step * more * 4  # reference, chaos, two candidates
            if not self.budget.can_pay(cost) or cost > POWER_SHARE * self.budget.left():
                return (
                    f"the fp32 reference did not learn over {self.steps} steps; the budget could not pay "
                    f"for {more}"
                )
            started = clock.now()
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
            took_s = clock.now() - started
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
        if trial == cand and not cand.compile and traj.series:  # (not a fix search's trials)
            self._eager[(trial, steps)] = traj
        if self.reference.dropped_imaginary:  # the model's own cast, in fp32 as well: not the candidate's
            traj.dropped_imaginary = None
        ref = replace(self.reference, losses=self.reference.losses[:steps])
        cmp = compare(ref, traj)
        floor = self.loss_floor(cand, steps)
        untested = never_ran(cand, traj)
        if untested:
            return False, untested, cmp, traj
        passed, reason = judge(
            cmp,
            traj,
            self.thresholds[cand.threshold_key],
            steps,
            floor,
            rounding_format(cand),
            losses_have_power=not self.learning,
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
        twin's run: the formats it rounds to are the same, so are the trends of its ranges. The
        twin's own check made that run already where it came first (a tune checks eager, then
        compiled): run again, it took a compiled check of the nanoGPT on the AMX Xeon ~15 s more."""
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
            return f"at risk: {seen.describe(self.train_steps, TRAIN_STEPS_SETTING)}"
        stall = stall_outlook(
            traj, self.thresholds[cand.threshold_key].max_stalled_update_fraction, self.train_steps
        )
        if stall is not None:
            return f"at risk: {stall}"
        return None
