"""The state and the stages of one tune (:func:`mixprec.tuning.run.tune` runs them in order).

1. Speed: the backend's tune plan (every supported policy x layout, eager), paired with strict
   fp32 (hopeless ones pruned), first within ``SPEED_SHARE`` of the budget; what that share did
   not reach is measured after the numerics checks with the time they left.
2. Numerics: the candidates that beat strict fp32, fastest first; a failing one may be rescued by
   a keep_fp32 set, which is then measured at its real cost.
3. Beyond eager: the best passing candidates again compiled (``torch.compile``, XLA; and their
   numerics, since fused kernels round differently), and the pick with the optimizer's other
   implementations. Compilation is paid once: candidates are compared over ``train_steps``.
4. Race the finalists against each other (:mod:`mixprec.measure.race`), then decide
   (:func:`mixprec.tuning.decide.decide`) with the race's verdicts; a passing candidate still too
   noisy to rank is re-measured once when the budget allows, and the decision taken again.

What the budget left unmeasured (the sweep's unreached candidates, compiled candidates it could not
pay for, numerics it could not check) and what was only predicted are rows of the decision table
(:class:`mixprec.tuning.decide.Untried`), with what measuring them would have cost.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from mixprec.budget import Budget
from mixprec.checking.check import Checker, check, cured, make_checker
from mixprec.errors import UsageError
from mixprec.events import Event, Events
from mixprec.frameworks import Framework
from mixprec.frameworks.session import BenchSettings
from mixprec.hardware.device import DeviceInfo, detect
from mixprec.measure.compile_cache import CompileCosts, cost_key
from mixprec.measure.race import FIRST_ROUNDS, Race, paired_rounds, race
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.measure.sweep import run_sweep
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.policy import POLICY_NAMES, Candidate
from mixprec.policy.islands import batch_norm_layers
from mixprec.status import Status
from mixprec.tuning import batching, compiling
from mixprec.tuning.batching import BatchPlan
from mixprec.tuning.compiling import MIN_COMPILE_S
from mixprec.tuning.config import TuneConfig
from mixprec.tuning.decide import Recommendation, Untried, amortized, decide, speed
from mixprec.tuning.order import ordered

# Share of the budget the eager speed sweep takes first; numerics, compile and rescues get the
# rest, and what the sweep did not reach is measured after the numerics checks if time is left.
SPEED_SHARE = 0.45
# Seconds kept back at the end for deciding, linting and writing.
RESERVE_S = 10.0
# More graph breaks than this and a compiled candidate's row says so: none for a compiled model;
# a compiled step breaks at backward() (twice in dynamo's count) and at optimizer.zero_grad, and
# the loss scaler's calls break it again.
GRAPH_BREAKS_NOTED = 0
STEP_GRAPH_BREAKS = 8
# Below this share of step time in matmul/conv/attention, precision is not where the time goes.
LOW_COMPUTE_SHARE = 0.5
# The race: the fastest passing candidate and up to this many others within this share of it.
RACE_RIVALS = 2
RACE_WINDOW = 0.25
# The share of the budget compiling leaves to the race (the last word on the pick).
RACE_SHARE = 0.15
# What checking a compiled candidate's numerics costs on top of an eager check, in multiples of its
# measured compile (its first step beyond a steady one): its training step compiles again (other
# graphs than the speed run's: no cache hit), and recompiles as its optimizer state appears. On the
# default tune (ResNet-50, the EPYC) bf16-mixed+compile-step's speed run compiled in 19 s; its check,
# unpriced, took 189 s and ran the 300 s budget to 6 min 39 s (it compiled a first-step probe and
# recompiled when the probe's hooks came off; both gone: the whole check now takes 66 s).
CHECK_COMPILES = 3.0
# A checked training step over a measured one of the same candidate: deep copies, the range
# recorder's hooks, the loss read at every step (the default tune on the quiet EPYC: 7.8-8.4 s for an
# fp32 run of 6 steps and its first-step probe, against 1.04-1.14 s steps).
CHECK_STEP_COST = 1.15
# One per-layer range collection (the reference's once, then each candidate's), in strict-fp32
# steps: every module's forward and backward tensors folded into full range histograms (ResNet-50
# at 128 px on that EPYC: 6.3 s each against the 1.04 s step).
RANGES_STEPS = 6.0
# The late speed sweep leaves this many times one check's estimated cost (stopping a candidate's
# process and the estimate's error take some of it)
CHECK_ROOM = 1.5
# Warm-up steps of a racing session: fixed (the first compiles, the second may recompile); the
# first step of each round is left out of its figure anyway.
RACE_WARMUP = 3


class Search:
    """The state of one tune: the backend, the sweep's rows, the verdicts, the shared fp32
    checker, the budget and the event stream."""

    def __init__(
        self,
        workload: Any,
        framework: Framework,
        config: TuneConfig,
        *,
        device: str,
        batch_size: int,
        budget: Budget,
        events: Events,
        batches: BatchPlan | None = None,
    ) -> None:
        """``batch_size``: the run's samples per optimizer step; ``batches``: each candidate's
        micro-batch (``tune --batch auto``), None to run every candidate at ``batch_size``."""
        self.workload, self.framework, self.device, self.config = workload, framework, device, config
        # what every sweep of this tune measures with; each stage names its candidates and baseline
        self.bench = replace(config.bench, device=device, batch_size=batch_size)
        self.batches = batches
        self.baseline = framework.baseline
        if batches is not None:
            batched = batches.batched(framework.baseline)
            if batched is None:
                choice = batches.choice(framework.baseline)
                why = f" ({choice.reason})" if choice is not None and choice.reason else ""
                raise UsageError(
                    f"strict fp32 fits no micro-batch{why} under the memory budget "
                    f"({batches.memory_budget} bytes, {batches.budget_source}): nothing to measure the "
                    "others against; raise --memory-budget."
                )
            self.baseline = batched
        self.noise, self.train_steps = config.noise, config.train_steps
        self.budget, self.events = budget, events
        self.notes: list[str] = list(getattr(workload, "notes", None) or [])  # a source's own (one rank)
        self.verdicts: dict[Candidate, CandidateCheck] = {}
        self.checked: CheckResult | None = None
        self._checkers: dict[int | None, Checker] = {}  # per micro-batch: the fp32 reference runs there
        self.result: BenchResult | None = None
        self.calibration = compiling.Calibration()
        self.race: Race | None = None
        self.phases: dict[str, float] = {}
        self.compile_s: dict[str | None, float] = {}  # the longest compile seen, per scope
        self.untried: dict[Candidate, Untried] = {}  # planned, not measured (or only predicted)
        self.not_checked: dict[Candidate, str] = {}  # numerics key -> why its check did not run
        self.compile_costs = CompileCosts()
        # what each eager numerics check took here over what check_cost_s estimated
        self._paces: list[float] = []

    def run(self, info: DeviceInfo, modes: Sequence[str]) -> tuple[Recommendation | None, list]:
        """The stages in order (see the module docstring); the decision and its table."""
        with self.phase("speed"):
            self.measure_speed(info)
        with self.phase("numerics"):
            self.check_faster()
        with self.phase("speed"):
            self.finish_speed(info)
        with self.phase("numerics"):
            self.check_faster()  # the candidates measured late, if any beat strict fp32
        with self.phase("compile"):
            self.try_compile(modes)
        with self.phase("race"):
            self.race_finalists()
        with self.phase("speed"):
            self.remeasure_noisy()
        rec, _ = self.decide()
        if rec is not None and self.config.optimizers and not rec.candidate.compile_scope:
            with self.phase("speed"):  # the pick's optimizer implementations: same numerics, maybe faster
                self.try_optimizers(rec)
            rec, _ = self.decide()
        if rec is not None and self.batches is not None:
            with self.phase("speed"):
                self.try_smaller_batch(rec)
            rec, _ = self.decide()
        with self.phase("prediction"):
            self.predict(info)  # rows and notes for hardware that runs them; they cannot change the pick
        return self.decide()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside against ``name`` (the report shows where the budget went)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def stage(self, text: str) -> None:
        self.events({"event": "stage", "text": text})

    def decide(self) -> tuple[Recommendation | None, list]:
        assert self.result is not None
        return decide(
            self.result.rows,
            self.verdicts,
            noise=self.noise,
            train_steps=self.train_steps,
            race=self.race,
            untried=list(self.untried.values()),
            not_checked=self.not_checked,
            budget_s=self.config.budget_s,
        )

    def measure_cost_s(self) -> float:
        """About what measuring one more eager candidate costs: the median wall time of the rows
        measured so far (set-up, warm-up and paired rounds), else the paired rounds' own time."""
        assert self.result is not None
        walls = sorted(
            r.wall_s
            for r in self.result.rows
            if r.wall_s and r.status == Status.OK and not r.baseline_repeat and r.candidate != self.baseline
        )
        if walls:
            return walls[len(walls) // 2]
        base = self.result.baseline
        step_s = base.step_time_ms.median_ms / 1e3 if base is not None and base.step_time_ms else 1.0
        return 1.3 * (self.bench.warmup + 2 * self.bench.steps + 2) * step_s

    def not_measured(self, candidates: Sequence[Candidate], why: str, cost_s: float | None = None) -> None:
        """Record ``candidates`` as planned but not measured because the budget ended (each a
        ``not-measured`` row of the decision table), with what measuring and checking each would
        cost: its measurement, plus a check where its numerics are not known yet."""
        assert self.result is not None
        families: set[Candidate] = set(self.verdicts)
        for cand in candidates:
            cost = self.measure_cost_s() if cost_s is None else cost_s
            if cand.policy != "fp32" and cand.numerics not in families:
                cost += self.check_cost_s(cand.numerics, cand.micro_batch)
                families.add(cand.numerics)
            self.untried[cand] = Untried(cand, Status.NOT_MEASURED, why, round(cost, 1))

    def _bench(
        self, candidates: Sequence[Candidate], budget: Budget, steps: int | None = None
    ) -> BenchResult:
        """One paired sweep of ``candidates`` (the workload was validated once, by tune); ``steps``
        paired rounds each instead of the run's."""
        if self.batches is not None:
            self.batches.timed.update(candidates)
        baseline = self.baseline if self.batches is not None else None

        def on_bench(event: Event) -> None:
            if event["event"] == "candidate":
                self.stage(f"measuring {event['label']} ({event['index'] + 1}/{event['count']})")
            elif event["event"] in ("row", "output", "step"):
                self.events(event)

        config = replace(
            self.bench, candidates=tuple(candidates), baseline=baseline, steps=steps or self.bench.steps
        )
        return run_sweep(
            self.workload, self.framework, config, device=self.device, events=on_bench, budget=budget
        )

    def _add(self, rows: Sequence[BenchRow]) -> list[BenchRow]:
        """Fold rows measured in another (paired) sweep into this one; the non-baseline ones."""
        assert self.result is not None
        added = [r for r in rows if r.candidate != self.baseline]
        for row in added:
            self.result.add(row)
        return added

    # ------------------------------------------------------------------ 1. speed
    def plan(self, info: DeviceInfo) -> list[Candidate]:
        """The backend's tune plan; with a batch plan, each at its micro-batch (those that fit)."""
        candidates = self.framework.tune_candidates(self.workload, info)
        plan = [self.framework.validate(c) for c in ordered(candidates, info)]
        if self.batches is None:
            return plan
        return [b for c in plan if (b := self.batches.batched(c)) is not None]

    def measure_speed(self, info: DeviceInfo) -> None:
        plan = self.plan(info)
        self.result = self._bench(plan, self.budget.share(SPEED_SHARE))
        if self.result.stopped:
            self.notes.append(f"speed sweep {self.result.stopped}")
            self.budget.cut(f"the speed sweep {self.result.stopped}")
            self._unreached(plan, f"not measured: the speed sweep {self.result.stopped}", info)
        self._over_budget()
        self._not_planned(info, {c.policy for c in plan} | self._unfit())

    def _unreached(self, planned: Sequence[Candidate], why: str, info: DeviceInfo) -> None:
        """The planned candidates the sweep did not reach: not measured, for the budget; those this
        device does not run get the row the sweep would have given them (unsupported: nothing
        to measure, so not something the budget prevented)."""
        assert self.result is not None
        seen = {r.candidate for r in self.result.rows}
        todo = [c for c in planned if c not in seen]
        supported = []
        for cand in todo:
            support = self.framework.support(cand, info)
            if support:
                supported.append(cand)
            else:
                hint = f"; try {support.suggestion}" if support.suggestion else ""
                self._add_unmeasured(cand, Status.UNSUPPORTED, support.reason + hint)
        self.not_measured(supported, why)

    def _add_unmeasured(self, cand: Candidate, status: str, reason: str) -> None:
        """A row for ``cand`` that was not timed (unsupported, over the memory budget), saying why."""
        assert self.result is not None
        self.result.add(
            BenchRow(self.result.workload, cand, self.device, self.result.batch_size, status, reason)
        )

    def _unfit(self) -> set[str]:
        """The policies the batch plan found no micro-batch for (their rows say why)."""
        if self.batches is None:
            return set()
        return {c.policy for c, m in self.batches.choices.items() if m.micro_batch is None}

    def _over_budget(self) -> None:
        """A row for each candidate the memory budget left no micro-batch: over-budget, or the
        failure that ended its memory search (an out-of-memory included)."""
        assert self.result is not None
        if self.batches is None:
            return
        for cand, choice in self.batches.choices.items():
            if choice.micro_batch is None:
                reason = choice.reason or f"no micro-batch dividing {self.batches.effective_batch} fits"
                self._add_unmeasured(cand, choice.status, reason)

    def _not_planned(self, info: DeviceInfo, planned: set[str]) -> None:
        """One row for each policy the plan leaves out, with why (unsupported, or not worth trying
        here), so the table lists every policy."""
        assert self.result is not None
        for name in POLICY_NAMES:
            if name in planned:
                continue
            cand = Candidate(name, framework=self.framework.name)
            support = self.framework.support(cand, info)
            why = support.reason + (f"; try {support.suggestion}" if support.suggestion else "")
            self._add_unmeasured(cand, Status.UNSUPPORTED, ("not tried by tune: " if support else "") + why)

    def finish_speed(self, info: DeviceInfo) -> None:
        """The candidates the speed sweep's share of the budget did not reach, measured with the
        time the numerics checks left: the share is what the sweep may take first, not a cap."""
        assert self.result is not None
        if not self.result.stopped or self.result.baseline is None:
            return  # without its strict-fp32 row nothing measured later has a reference
        first = f"speed sweep {self.result.stopped}"
        seen = {r.candidate for r in self.result.rows}
        todo = [c for c in self.plan(info) if c not in seen]
        if not todo or self.budget.expired():
            return
        more = self._bench(todo, self._leaving_a_check(todo))
        added = self._add(more.measured)
        self.notes.remove(first)
        self.budget.restore(f"the {first}")
        late = [r.label for r in added if r.status not in (Status.UNSUPPORTED, Status.ERROR)]
        what = f"; {', '.join(late)} measured later with the time the numerics checks left" if late else ""
        if more.stopped:
            self.notes.append(f"{first}{what}; the rest of the sweep {more.stopped}")
            self.budget.cut(f"the speed sweep {more.stopped}")
            self._unreached(todo, f"not measured: the rest of the speed sweep {more.stopped}", info)
            return
        self.result.stopped = None
        self.notes.append(f"{first}{what}")

    def _leaving_a_check(self, todo: Sequence[Candidate]) -> Budget:
        """The late sweep's budget: all that is left, less about one numerics check (with room to
        stop a candidate process) where the late candidates hold a lower precision whose numerics
        are not known yet. A sweep on a busy machine takes all the time it is given, and a faster
        candidate measured with none left to check it cannot be recommended: `make demo` beside
        two busy processes measured bf16-mixed at ~2x late and recommended fp32+cl, its numerics
        unpaid. (The time kept goes to the later stages when no check needs it.) Where what is
        left cannot pay for one more candidate and its check, nothing is kept: a speed measured
        without its verdict still tells the user what a larger --budget would check."""
        unknown = [c for c in todo if c.policy != "fp32" and c.numerics not in self.verdicts]
        if not unknown:
            return self.budget
        keep = CHECK_ROOM * max(self.check_cost_s(c.numerics, c.micro_batch) for c in unknown)
        if not self.budget.can_pay(self.measure_cost_s() + keep):
            return self.budget
        return self.budget.keeping(keep)

    # ------------------------------------------------------------------ 2. numerics
    def check_cost_s(self, candidate: Candidate | None = None, micro_batch: int | None = None) -> float:
        """About what checking ``candidate``'s numerics at ``micro_batch`` costs (``tune --batch
        auto``; None: the run's batch). ``candidate`` None: a lower precision not measured yet,
        priced at strict fp32's step. The candidate's training run and first-step probe at its
        measured step, its per-layer ranges, and the strict-fp32 runs it still needs (the reference
        and chaos runs and the reference's ranges for the first check at a micro-batch, one run a
        rounding of its half format apart once per format), times what checks took here against
        that estimate so far (:attr:`_check_pace`). Priced 2x per fp32 step and 4 runs for every
        first check, the default tune's first check of bf16-mixed was estimated at 220 s beside two
        busy processes on the 2-core EPYC and never started (priced from its runs, it took 113 s)."""
        assert self.result is not None
        key = micro_batch or self.baseline.micro_batch
        fp32_s = self._step_s(self.framework.baseline, key)
        cand_s = self._step_s(candidate, key) if candidate is not None else fp32_s
        checker = self._checkers.get(key)
        # the steps the checks compare (more than asked where a reference needed them to learn: a
        # new micro-batch's will too), and each run's first-step probe
        asked = max((c.steps for c in self._checkers.values()), default=self.config.check.steps)
        steps = (checker.steps if checker is not None else asked) + 1
        fp32_runs = 0 if checker is not None else 2
        if candidate is None or checker is None or checker.floor_run_needed(candidate):
            fp32_runs += 1
        ranges = 1 if checker is not None else 2
        seconds = CHECK_STEP_COST * steps * (fp32_runs * fp32_s + cand_s) + RANGES_STEPS * ranges * fp32_s
        return self._check_pace * seconds

    def _step_s(self, candidate: Candidate, micro_batch: int | None) -> float:
        """Seconds of one measured training step of ``candidate`` (a numerics key) at ``micro_batch``
        samples (None: the run's batch), from the rows measured so far: the time per sample of its
        own rows (those at that micro-batch first), else of the slowest row of its numerics, else
        of strict fp32's, times the samples of a checked step."""
        assert self.result is not None
        size = micro_batch or self.bench.batch_size or self.result.batch_size
        rows = [r for r in self.result.rows if r.status == Status.OK and r.throughput]
        own = [r for r in rows if r.candidate.unbatched == candidate.unbatched]
        found = (
            [r for r in own if r.batch_size == size]
            or own
            or [r for r in rows if r.candidate.numerics == candidate.numerics]
            or [r for r in rows if r.candidate.unbatched == self.framework.baseline.unbatched]
        )
        if not found:
            return 1.0
        return size / min(t for r in found if (t := r.throughput))

    def check_compile_s(self, row: BenchRow) -> float:
        """What compiling adds to the check of ``row``'s numerics: :data:`CHECK_COMPILES` times its
        measured compile (the cold prior where none was measured); nothing for an eager one."""
        if not row.candidate.compile:
            return 0.0
        return CHECK_COMPILES * (row.compile_s if row.compile_s is not None else MIN_COMPILE_S)

    def check(
        self, candidate: Candidate, fix: bool | None = None, micro_batch: int | None = None
    ) -> CandidateCheck:
        """The numerics of ``candidate`` (a numerics key), at ``micro_batch`` where the measured
        candidate runs one (``tune --batch auto``: checked at the micro-batch it would train at)."""
        if micro_batch not in self._checkers:
            at_size = replace(
                self.config.check, batch_size=micro_batch or self.bench.batch_size, device=self.device
            )
            self._checkers[micro_batch] = make_checker(
                self.workload, at_size, events=self.events, budget=self.budget
            )
        at = f" at micro-batch {micro_batch}" if micro_batch else ""
        self.stage(f"checking numerics of {candidate.label}{at}")
        estimate = self.check_cost_s(candidate, micro_batch) / self._check_pace
        started = time.perf_counter()
        res = check(
            self.workload,
            policies=(candidate,),
            fix=self.config.check.fix if fix is None else fix,
            checker=self._checkers[micro_batch],
            events=self.events,
        )
        if self.checked is None:
            self.checked = res
        else:
            self.checked.candidates.extend(res.candidates)
        verdict = res.candidates[0]
        self.verdicts[candidate] = verdict
        self.not_checked.pop(candidate, None)
        searched = verdict.fix_keep_fp32 or verdict.fix_keep_bf16 or verdict.fix_note
        whole = verdict.verdict != Status.ERROR and len(verdict.losses) >= self._checkers[micro_batch].steps
        if estimate and whole and not candidate.compile and not searched:
            # the next estimate follows this machine's pace (a busy one, hooks that cost more here),
            # the mean of the checks so far (the first pays one-time costs); a compile, a rescue
            # search or a run that ended early in the time says nothing about the next check
            self._paces.append(min(max((time.perf_counter() - started) / estimate, 0.5), 4.0))
        return verdict

    @property
    def _check_pace(self) -> float:
        """What checks took here over their estimates: the mean of the eager ones so far (1.0
        before any)."""
        return sum(self._paces) / len(self._paces) if self._paces else 1.0

    def check_faster(self) -> None:
        """Check the candidates that beat strict fp32, fastest policy first; stop once one passed
        and nothing is left within ``RACE_WINDOW`` of it: each figure was divided by its own
        neighbouring fp32 rounds, so a candidate that close may still win the race (it must pass
        to run in it)."""
        assert self.result is not None
        faster = sorted(
            (
                r
                for r in self.result.rows
                if r.status == Status.OK and r.policy != "fp32" and not r.baseline_repeat and speed(r) > 1.0
            ),
            key=lambda r: -speed(r),
        )
        passed = [r for r in faster if (v := self.verdicts.get(r.candidate.numerics)) and v.acceptable]
        best_pass: BenchRow | None = max(passed, key=speed) if passed else None  # from a first round
        for numerics in dict.fromkeys(r.candidate.numerics for r in faster):
            if numerics in self.verdicts:
                continue
            top = max((r for r in faster if r.candidate.numerics == numerics), key=speed)
            if best_pass is not None and speed(top) < speed(best_pass) * (1 - RACE_WINDOW):
                break  # too slow to be a finalist: it cannot win
            cost = self.check_cost_s(numerics, top.candidate.micro_batch) + self.check_compile_s(top)
            if not self.budget.can_pay(cost):
                self.notes.append(
                    f"numerics of {numerics.label} not checked: the budget could not pay the about "
                    f"{cost:.0f} s its check would take (--budget raises it)"
                )
                self.budget.cut(f"the numerics of {numerics.label} were not checked")
                for left in dict.fromkeys(r.candidate.numerics for r in faster):
                    if left not in self.verdicts:
                        self.not_checked[left] = (
                            f"numerics not checked: the budget ended first (about "
                            f"{self.check_cost_s(left):.0f} s more would check it)"
                        )
                break
            verdict = self.check(numerics, micro_batch=top.candidate.micro_batch)
            if verdict.acceptable and (best_pass is None or speed(top) > speed(best_pass)):
                best_pass = top
            elif (
                (verdict.fix_keep_fp32 or verdict.fix_keep_bf16)
                and verdict.fix_verified
                and not self.budget.expired()
            ):
                self.rescue(faster, verdict)

    def rescue(self, faster: list[BenchRow], verdict: CandidateCheck) -> None:
        """Measure a failing policy rescued by keep_fp32 or a precision map (neither is free: fp32
        islands and bf16 layers run slower); its verdict is built from the verifying run's figures."""
        base = verdict.candidate
        layouts = sorted({r.channels_last for r in faster if r.candidate.numerics == base})
        rescued = [
            replace(
                base,
                channels_last=cl,
                keep_fp32=(*base.keep_fp32, *verdict.fix_keep_fp32),
                keep_bf16=(*base.keep_bf16, *verdict.fix_keep_bf16),
            )
            for cl in layouts
        ]
        if self.batches is not None:  # the numerics key has no micro-batch: the measured one's
            rescued = [b for c in rescued if (b := self.batches.batched(c)) is not None]
        fix = (
            f"keep_fp32={verdict.fix_keep_fp32}"
            if verdict.fix_keep_fp32
            else f"keep_bf16={verdict.fix_keep_bf16}"
        )
        self.stage(f"measuring rescued {base.label} with {fix}")
        measured = self._bench(rescued, self.budget).measured
        added = self._add([r for r in measured if r.candidate.keep_fp32 or r.candidate.keep_bf16])
        if not added:
            self.notes.append(f"rescued {base.label} not measured: budget spent")
            self.budget.cut(f"rescued {base.label} was not measured")
            return
        # The rescued candidate is judged as every candidate is (over the run: ranges, trends,
        # stalls), not taken from the search's verifying run.
        fixed = self.check(rescued[0].numerics, fix=False, micro_batch=rescued[0].micro_batch)
        if fixed.passed:
            fixed.reason = cured(verdict, fixed)

    def predict(self, info: DeviceInfo) -> None:
        """Candidates the device cannot run fast but whose numerics can be computed here (fp8 on a
        CPU through torchao's recipe): say whether they would pass, a labelled prediction, never a
        measured speed."""
        predicted, notes = self.framework.predictions(self.workload, info)
        self.notes += notes
        for i, cand in enumerate(predicted):
            if not self.budget.can_pay(self.check_cost_s(cand)):
                self.notes.append(f"{cand.label} numerics not predicted: budget spent (--budget raises it)")
                for left in predicted[i:]:
                    self.untried[left] = Untried(
                        left,
                        Status.PREDICTED,
                        f"not predicted: the budget ended first; its speed cannot be measured on this "
                        f"device (no {left.spec.compute_format} tensor cores)",
                    )
                return
            verdict = self.check(cand, micro_batch=self.baseline.micro_batch)
            outcome = (
                "would pass"
                if verdict.passed
                else "is inconclusive on"
                if verdict.verdict == Status.INCONCLUSIVE
                else "would fail"
            )
            self.untried[cand] = Untried(
                cand,
                Status.PREDICTED,
                f"predicted only: {outcome} the numerics check ({verdict.reason}); its speed cannot be "
                f"measured on this device (no {cand.spec.compute_format} tensor cores)",
                verdict=str(verdict.verdict),
            )
            mapped = ""
            if verdict.fix_keep_bf16 and verdict.fix_verified:
                mapped = (
                    f"; with the precision map keep_bf16={verdict.fix_keep_bf16} it would pass "
                    f"({verdict.fix_note})"
                )
            self.notes.append(
                f"{cand.label} {outcome} the numerics check on an {cand.spec.compute_format} GPU "
                f"({verdict.reason}){mapped}; {verdict.predicted or 'predicted here, speed not measured'}"
            )

    # ------------------------------------------------------------------ 3. beyond eager
    def try_compile(self, modes: Sequence[str]) -> None:
        """Compiled variants chosen by what compiling can gain (:mod:`mixprec.tuning.compiling`):
        one per precision family first, most promising first (re-planned after each measurement
        recalibrates the prediction), each followed by its numerics check, then the other scopes
        while the budget pays. A candidate is compiled only if its prediction could reach the race;
        every attempt skipped is named with its predicted figure and why."""
        assert self.result is not None
        if not modes or self.decide()[0] is None:
            return
        budget = self.budget.share(1 - RACE_SHARE)  # what compiling may take: the race gets the rest
        skipped: dict[Candidate, str] = {}
        while True:
            failed = {c for c, v in self.verdicts.items() if not v.acceptable}
            tried = {r.candidate for r in self.result.rows} | set(skipped)
            todo = compiling.plan(self.framework, self.result.rows, failed, modes, self.calibration)
            attempt = next((a for a in todo if a.candidate not in tried), None)
            if attempt is None:
                break
            candidate = attempt.candidate
            compile_s, priced, known = self._compile_price(candidate, [a.candidate for a in todo])
            best = self.decide()[0]
            best_speed = (best.speedup_vs_fp32 or 1.0) if best is not None else 1.0
            predicted = f"predicted {attempt.speedup:.2f}x: {attempt.basis}; compile priced {priced}"
            # Predicted too far below the best to race, it cannot be the pick: its compile is budget
            # taken from one that could (fp32's family too, which needs no check). The default tune of
            # ResNet-50 on the EPYC spent 81 s compiling fp32+cl+compile-step, predicted 1.40x beside
            # a measured 2.00x, until the budget stopped it.
            if attempt.speedup < best_speed * (1 - RACE_WINDOW):
                skipped[candidate] = (
                    f"{candidate.label} (too far below the best {best_speed:.2f}x to race; {predicted})"
                )
                continue
            # measuring it compiles once, checking it compiles again (other graphs: CHECK_COMPILES).
            # A first compile is only the prior's guess: what measuring it costs is gated here, and
            # its check once the measured compile prices it (below). Gated on 4.5x the prior, the
            # default tune of the nanoGPT-style GPT on the EPYC, its eager stages slowed by other
            # work beside it, compiled nothing (73 s left for compiling, 112 s priced), where its
            # step compiles in 5-12 s and runs 1.2x faster than the eager pick.
            check_s = self.check_cost_s(candidate.numerics, candidate.micro_batch)
            compiles = 1.5 + (CHECK_COMPILES if known else 0.0)
            if not budget.can_pay(compiles * compile_s + check_s):
                skipped[candidate] = f"{candidate.label} (the budget could not pay; {predicted})"
                self.not_measured(
                    [candidate],
                    f"not compiled: the budget could not pay for its compile and check ({predicted})",
                    1.5 * compile_s + self.measure_cost_s(),
                )
                continue
            self.stage(f"compiling {candidate.label}: {predicted}")
            measured = self._add(self._bench([candidate], budget).measured)
            row = next((r for r in measured if r.candidate == candidate), None)
            if row is None:
                skipped[candidate] = f"{candidate.label} (stopped by the budget while compiling)"
                self.not_measured(
                    [candidate],
                    f"not measured: the budget ended while it compiled ({predicted})",
                    1.5 * compile_s + self.measure_cost_s(),
                )
                continue
            if row.status != Status.OK:
                continue
            if row.compile_s is not None:
                self.compile_costs.record(self._cost_key(candidate), row.compile_s)
                scope = candidate.compile_scope
                self.compile_s[scope] = max(self.compile_s.get(scope, 0.0), row.compile_s)
            self.calibration.update(attempt, row)
            self._note_graphs(row)
            check_s = self.check_cost_s(candidate.numerics, candidate.micro_batch) + self.check_compile_s(row)
            if candidate.numerics not in self.verdicts and budget.can_pay(check_s):
                self.check(candidate.numerics, micro_batch=candidate.micro_batch)
        if skipped:
            self.notes.append(f"not compiled: {'; '.join(skipped.values())} (--budget raises the budget)")
            if any("budget" in why for why in skipped.values()):
                self.budget.cut("compiled candidates were not measured")

    def _cost_key(self, candidate: Candidate) -> str:
        assert self.result is not None
        machine = detect(self.device).name
        batch = self.bench.batch_size or 0
        threads = self.bench.threads if isinstance(self.bench.threads, int) else self.framework.threads()
        return cost_key(self.framework.name, self.result.workload, batch, candidate.label, machine, threads)

    def _compile_price(
        self, candidate: Candidate, siblings: Sequence[Candidate] = ()
    ) -> tuple[float, str, bool]:
        """Seconds compiling ``candidate`` should take, why, and whether that was measured (on this
        machine): what it cost here before (a compile whose artefacts are in Inductor's cache is
        cheap), else the longest compile of its scope this run, else the longest first compile
        here of it (its artefacts gone) or its ``siblings`` (the other compiled candidates of this
        workload: it compiles cold too), else the cold prior (a guess)."""
        before = self.compile_costs.price(self._cost_key(candidate))
        if before is not None:
            return before.seconds, f"{before.seconds:.0f} s ({before.basis})", True
        seen = self.compile_s.get(candidate.compile_scope)
        if seen is not None:
            seen = max(seen, MIN_COMPILE_S)  # another family's graphs: maybe not in the cache
            return seen, f"{seen:.0f} s (its scope's longest compile this run)", True
        # Only a compile nothing is known of is gated on measuring it alone (the prior is a guess,
        # often far above what compiling costs). Priced by the prior, the model scope of the
        # default ResNet-50 tune on the EPYC was measured (a 25 s compile) and left unchecked, where
        # the leader's step scope, its compile known (19 s), was not started: it and its check
        # could not be paid.
        colds = [self.compile_costs.cold_s(self._cost_key(c)) for c in {candidate, *siblings}]
        known = [s for s in colds if s is not None]
        if known:
            cold = max(known)
            return cold, f"{cold:.0f} s (the longest first compile of this model's candidates here)", True
        return MIN_COMPILE_S, f"{MIN_COMPILE_S:.0f} s (a first compile here)", False

    def _note_graphs(self, row: BenchRow) -> None:
        """Say when a compiled candidate breaks into more graphs than its scope needs: each break
        stops fusion across it (a compiled step breaks at backward() and zero_grad by design)."""
        expected = STEP_GRAPH_BREAKS if row.candidate.compile_scope == "step" else GRAPH_BREAKS_NOTED
        if row.graph_breaks and row.graph_breaks > expected:
            scope = "step" if row.candidate.compile_scope == "step" else "model"
            self.notes.append(
                f"{row.label}: the {scope} compiles into {row.graphs} graphs with {row.graph_breaks} graph "
                f"breaks; each one splits the compiled graph and stops fusion across it "
                "(torch._dynamo.explain(fn)(batch) lists where and why)"
            )

    def try_optimizers(self, rec: Recommendation) -> None:
        """The pick with its optimizer's other implementations (for-loop / foreach / fused): same
        numerics, possibly faster steps. Only the ones the optimizer class offers."""
        if rec.candidate.optimizer:
            return
        todo = self.framework.optimizer_variants(self.workload, rec.candidate)
        assert self.result is not None
        base = self.result.baseline
        step_s = base.step_time_ms.median_ms / 1e3 if base is not None and base.step_time_ms else 1.0
        # each variant warms up and runs its paired rounds next to strict fp32 (compiled: from cache)
        cost = len(todo) * (1.3 * (self.bench.warmup + 2 * self.bench.steps + 2) * step_s)
        if rec.candidate.compile:
            cost += len(todo) * MIN_COMPILE_S / 3
        if todo and not self.budget.can_pay(cost):
            self.notes.append(
                f"the optimizer's implementations of {rec.label} not measured: budget spent "
                "(--budget raises it)"
            )
            return
        if todo:
            self.stage(f"measuring the optimizer's implementations: {', '.join(c.label for c in todo)}")
            self._add(self._bench(todo, self.budget).measured)

    def try_smaller_batch(self, rec: Recommendation) -> None:
        """The pick one micro-batch down (``tune --batch auto``): a cache-bound step can be faster
        there, and then it is the pick and the next size down is measured too; where it is as fast
        within the noise, a note says so (the knee: the same speed with less memory). The grid of
        sizes is never timed whole."""
        if self.batches is None:
            return
        current = rec.candidate
        while (smaller := self.batches.smaller(current)) is not None:
            assert self.result is not None
            base = self.result.baseline
            step_s = base.step_time_ms.median_ms / 1e3 if base is not None and base.step_time_ms else 1.0
            cost = 1.3 * (self.bench.warmup + 2 * self.bench.steps + 2) * step_s
            if not self.budget.can_pay(cost):
                self.notes.append(f"{smaller.label} not measured: budget spent (--budget raises it)")
                return
            self.stage(f"measuring the pick one micro-batch down: {smaller.label}")
            rows = self._add(self._bench([smaller], self.budget).measured)
            picked, _ = self.decide()
            if picked is not None and picked.candidate == smaller:
                current = smaller
                continue
            row = next((r for r in rows if r.candidate == smaller and r.status == Status.OK), None)
            mine = next((r for r in self.result.rows if r.candidate == current), None)
            if row is not None and mine is not None and speed(row) >= speed(mine) * (1 - self.noise):
                self.notes.append(
                    f"{smaller.label} is within {self.noise:.0%} of {current.label}'s speed "
                    f"({speed(row):.2f}x against {speed(mine):.2f}x) with a smaller micro-batch: "
                    "the throughput has flattened there"
                )
            return

    def note_compute_share(self, rec: Recommendation) -> None:
        """Say where the next gain is when the pick spends most of its step outside matmuls."""
        assert self.result is not None
        row = next((r for r in self.result.rows if r.candidate == rec.candidate), None)
        share = row.compute_share if row is not None else None
        if share is not None and share < LOW_COMPUTE_SHARE:
            hint = "" if rec.candidate.compile else "; compiling fuses the elementwise rest"
            self.notes.append(
                f"{rec.label} spends {share:.0%} of its profiled step in matmul/conv/attention: lower "
                f"precision speeds up only that share, the rest is elementwise ops, the optimizer and "
                f"framework overhead{hint}"
            )

    # ------------------------------------------------------------------ 4. the race
    def race_finalists(self) -> None:
        """The finalists measured against each other (:mod:`mixprec.measure.race`): the fastest
        passing candidate and up to ``RACE_RIVALS`` others within ``RACE_WINDOW`` of it, each
        paired with the leader itself until their difference is resolved, measured to be a tie
        within the noise floor, or the budget ends it."""
        assert self.result is not None
        rec, table = self.decide()
        if rec is None:
            return
        base = self.result.baseline
        passing = [  # a noisy candidate races too: a duel with the leader resolves it
            r.row
            for r in table
            if r.status in (Status.PASS, Status.RECOMMENDED, Status.NOISY, Status.INCONCLUSIVE)
            and r.row is not None
        ]

        def effective(row: BenchRow) -> float:
            return amortized(row, base, self.train_steps)

        passing.sort(key=effective, reverse=True)
        if len(passing) < 2:
            return
        leader = passing[0]
        rivals = [r for r in passing[1:] if effective(r) >= effective(leader) * (1 - RACE_WINDOW)][
            :RACE_RIVALS
        ]
        if not rivals:
            return
        step_s = max(
            (r.step_time_ms.median_ms / 1e3 for r in [leader, *rivals] if r.step_time_ms), default=1.0
        )
        warm_up = RACE_WARMUP

        def cost_s(n: int, rounds: int) -> float:
            # the leader and each rival warm up, then every round runs a side each; a compiled
            # session compiles again (from inductor's cache, about a third of a cold compile)
            compiled = sum(1 for r in [leader, *rivals[:n]] if r.candidate.compile)
            return 1.3 * (n + 1) * (warm_up + 2 * rounds) * step_s + compiled * MIN_COMPILE_S / 3

        self.stage(f"racing {', '.join(r.label for r in rivals)} against {leader.label}")
        settings = BenchSettings(
            device=self.device,
            batch_size=self.result.batch_size,
            steps=FIRST_ROUNDS,
            warmup=RACE_WARMUP,
            adaptive_warmup=False,
            threads=self.bench.threads if isinstance(self.bench.threads, int) else self.framework.threads(),
        )
        isolate = self.workload.spec is not None and self.framework.session_builder() is not None
        measure = paired_rounds(
            self.framework, self.workload, settings, isolate=isolate, events=self.events, budget=self.budget
        )
        self.race = race(
            leader.candidate,
            [r.candidate for r in rivals],
            measure,
            noise=self.noise,
            budget=self.budget,
            cost_s=cost_s,
            between_run_sd=self.result.between_run_sd,
        )
        for duel in self.race.duels:
            self.notes.append(f"race: {duel.describe()}")
        if self.race.stopped:
            self.notes.append(f"race stopped: {self.race.stopped}")

    def remeasure_noisy(self) -> None:
        """The passing candidates the decision set aside as too noisy to rank that could still beat
        the pick (:attr:`Recommendation.remeasure`), measured once more with twice the paired rounds
        while the budget pays; the new row replaces the noisy one. What the budget cannot pay stays
        set aside, and the recommendation says so."""
        assert self.result is not None
        rec = self.decide()[0]
        if rec is None or not rec.remeasure:
            return
        steps = 2 * self.bench.steps
        for cand in rec.remeasure:
            old = next((r for r in self.result.rows if r.candidate == cand), None)
            cost = 2 * self.measure_cost_s() + (MIN_COMPILE_S / 3 if cand.compile else 0.0)
            if old is None:
                continue  # nothing measured to replace
            if not self.budget.can_pay(cost):
                self.notes.append(f"{cand.label} not re-measured: budget spent (--budget raises it)")
                return
            self.stage(f"re-measuring {cand.label}: too noisy to rank")
            row = next(
                (r for r in self._bench([cand], self.budget, steps=steps).measured if r.candidate == cand),
                None,
            )
            if row is None or row.status != Status.OK:
                self.notes.append(f"{cand.label} not re-measured: {row.reason if row else 'budget spent'}")
                continue
            first = f"{old.speedup_vs_fp32 or 0:.2f}x"
            if old.speedup_ci:
                first += f" [{old.speedup_ci[0]:.2f}-{old.speedup_ci[1]:.2f}]"
            note = (
                f"re-measured with {steps} paired rounds: the first measurement ({first}) was too noisy to "
                "rank"
            )
            self.result.update(replace(row, notes=(*row.notes, note)))
            self.notes.append(f"{cand.label} {note}")

    # ------------------------------------------------------------------ after the pick
    def lint(self, rec: Recommendation) -> list[dict[str, Any]] | None:
        """The backend's lint findings under the pick, whole (layout and fp32 islands included)."""
        try:
            return self.framework.lint(self.workload, rec.candidate, self.device)
        except Exception as exc:  # lint is advice: its failure must not lose the recommendation
            self.notes.append(f"lint failed: {type(exc).__name__}: {exc}")
            return None

    def complete(self, rec: Recommendation, findings: list[dict[str, Any]] | None) -> Recommendation:
        """The pick whole: the micro-batch and accumulation it trains with, its measured peak memory,
        the lint findings worth fixing under it; the notes about its batch and its compute share."""
        assert self.result is not None
        row = next((r for r in self.result.rows if r.candidate == rec.candidate), None)
        plan = self.batches
        measured = plan.peak(rec.candidate) if plan is not None else None
        if plan is not None:
            model = getattr(
                self.workload, "model", None
            )  # a torch workload's: BatchNorm follows the micro-batch
            batch_norm = isinstance(model, torch.nn.Module) and bool(batch_norm_layers(model))
            self.notes += batching.notes(plan, self.framework.default_batch_size(self.workload), batch_norm)
        self.note_compute_share(rec)
        return replace(
            rec,
            micro_batch=rec.candidate.micro_batch or self.bench.batch_size,
            accumulation_steps=rec.candidate.accumulation_steps,
            peak_memory_bytes=measured if measured is not None else (row.peak_memory_bytes if row else None),
            lint_worth_fixing=[f for f in findings or [] if f.get("severity") in ("warning", "error")][:5],
        )
