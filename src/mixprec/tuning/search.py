"""The state and the stages of one tune (:func:`mixprec.tuning.run.tune` runs them in order).

1. Speed: the backend's tune plan (every supported policy x layout, eager), paired with strict
   fp32 (hopeless ones pruned), first within ``SPEED_SHARE`` of the budget (a candidate under way
   when it ends is finished, unless the time is owed to a check); what that share did not reach is
   measured after the numerics checks with the time they left.
2. Numerics: the candidates that beat strict fp32, fastest first; a failing one may be rescued by
   a keep_fp32 set, which is then measured at its real cost.
3. Beyond eager: the best passing candidates again compiled (``torch.compile``, XLA; and their
   numerics, since fused kernels round differently), and the pick with the optimizer's other
   implementations. Compilation is paid once: candidates are compared over ``train_steps``.
4. Race the finalists against each other (:mod:`mixprec.measure.race`), then decide
   (:func:`mixprec.tuning.decide.decide`) with the race's verdicts; a passing candidate still too
   noisy to rank is re-measured once when the budget allows, and the decision taken again.

Every stage asks the cost model (:mod:`mixprec.tuning.cost`) what its next step would cost; the
numerics checks are :mod:`mixprec.tuning.checks`'s. What the budget left unmeasured (the sweep's
unreached candidates, compiled candidates it could not pay for, numerics it could not check) and
what was only predicted are rows of the decision table (:class:`mixprec.tuning.decide.Untried`),
with what measuring them would have cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from mixprec import clock
from mixprec.budget import INTERRUPTED, Budget, what_ended
from mixprec.checking.check import Checker, cured
from mixprec.errors import UsageError
from mixprec.events import Event, Events
from mixprec.frameworks import Framework
from mixprec.frameworks.session import BenchSettings
from mixprec.hardware.device import DeviceInfo
from mixprec.measure.race import FIRST_ROUNDS, Measure, Race, paired_rounds, race
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.measure.sweep import after_slow_carriers, retried, run_sweep, stalled, stopped_measuring
from mixprec.numerics.results import CandidateCheck
from mixprec.policy import POLICY_NAMES, Candidate, Support
from mixprec.policy.islands import batch_norm_layers
from mixprec.status import Status
from mixprec.tuning import batching, compiling
from mixprec.tuning.batching import BatchPlan
from mixprec.tuning.checks import Checks
from mixprec.tuning.config import TuneConfig
from mixprec.tuning.cost import RACE_WARMUP, Costs
from mixprec.tuning.decide import Ranked, Recommendation, Untried, decide
from mixprec.tuning.held import Held
from mixprec.tuning.order import tune_plan
from mixprec.tuning.speedups import amortized, speed

# Share of the budget the eager speed sweep takes first; numerics, compile and rescues get the
# rest, and what the sweep did not reach is measured after the numerics checks if time is left.
SPEED_SHARE = 0.45
# Seconds kept back at the end for deciding, linting and writing.
RESERVE_S = 10.0
# The race: the fastest passing candidate and up to this many others within this share of it.
RACE_RIVALS = 2
RACE_WINDOW = 0.25
# The share of the budget compiling leaves to the race (the last word on the pick).
RACE_SHARE = 0.15
# At most this share of the budget is kept back to settle the pick's figure (tuning/settle.py): two
# sessions of ResNet-50's at 128 px on a 2-core EPYC (about 35 s each), so that a third can break a
# tie (0.15 paid one, and bench_vs_tune's run 17 printed the mean of two that disagreed).
SETTLE_SHARE = 0.25
# Below this share of step time in matmul/conv/attention, precision is not where the time goes.
LOW_COMPUTE_SHARE = 0.5


class Sweeps:
    """What one tune measures with, and what its stages all add to: the backend and workload, the
    settings every sweep measures with (each stage names its candidates and baseline), each
    candidate's micro-batch, the budget, the event stream, the notes and the time per phase."""

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
        self.budget, self.events = budget, events
        self.notes: list[str] = list(getattr(workload, "notes", None) or [])  # a source's own (one rank)
        self.phases: dict[str, float] = {}
        self.started: dict[str, float] = {}  # label -> when its session last began opening

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside against ``name`` (the report shows where the budget went)."""
        start = clock.now()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + clock.now() - start

    def stage(self, text: str) -> None:
        self.events({"event": "stage", "text": text})

    def racing(self, batch_size: int) -> Measure:
        """Paired rounds of two candidates, each in its own session (a process where the workload
        can be rebuilt in one), at a fixed warm-up: what the race measures with."""
        settings = BenchSettings(
            device=self.device,
            batch_size=batch_size,
            steps=FIRST_ROUNDS,
            warmup=RACE_WARMUP,
            adaptive_warmup=False,
            threads=self.bench.threads if isinstance(self.bench.threads, int) else self.framework.threads(),
        )
        isolate = self.workload.spec is not None and self.framework.session_builder() is not None
        return paired_rounds(
            self.framework, self.workload, settings, isolate=isolate, events=self.events, budget=self.budget
        )

    def plan(self, info: DeviceInfo) -> list[Candidate]:
        """The backend's tune plan; with a batch plan, each at its micro-batch (those that fit)."""
        plan = tune_plan(self.framework, self.workload, info, self.config.policy_names)
        if self.batches is None:
            return plan
        return [b for c in plan if (b := self.batches.batched(c)) is not None]

    def sweep(
        self,
        candidates: Sequence[Candidate],
        budget: Budget,
        steps: int | None = None,
        finish_within: Callable[[BenchResult], Budget] | None = None,
        earlier: Sequence[BenchRow] = (),
    ) -> BenchResult:
        """One paired sweep of ``candidates`` (the workload was validated once, by tune); ``steps``
        paired rounds each instead of the run's; ``finish_within`` and ``earlier``: :func:`run_sweep`'s."""
        if self.batches is not None:
            self.batches.timed.update(candidates)
        baseline = self.baseline if self.batches is not None else None

        def on_bench(event: Event) -> None:
            if event["event"] == "candidate":
                self.started[event["label"]] = clock.now()
                self.stage(f"measuring {event['label']} ({event['index'] + 1}/{event['count']})")
            elif event["event"] in ("row", "output", "step"):
                self.events(event)

        config = replace(
            self.bench, candidates=tuple(candidates), baseline=baseline, steps=steps or self.bench.steps
        )
        return run_sweep(
            self.workload,
            self.framework,
            config,
            device=self.device,
            events=on_bench,
            budget=budget,
            finish_within=finish_within,
            earlier=earlier,
            pool=bool(self.config.settle),
        )

    def past_share(self, partial: BenchResult) -> Budget:
        """How long a candidate under way when the speed sweep's share ran out may take to finish
        (``partial``: the sweep's rows so far): the budget, less a check of a candidate that already
        beat strict fp32 (checked next) and what settling the pick's figure may keep back (taken
        from the budget before that check). Stopped, its rounds are lost, and the late sweep
        measures it again from its start."""
        costs, share = Costs(partial, self, {}), SETTLE_SHARE * self.budget.seconds
        owed = costs.check_room([r.candidate for r in _faster(partial.rows)], ())
        # (what settling the fastest row so far would cost; the whole share before any row is timed)
        fastest = fastest_row(partial.rows)
        settling = share if fastest is None else costs.settling_s(fastest, share)[0]
        return self.budget.keeping(owed + (settling if self.config.settle else 0.0))

    # ------------------------------------------------------------------ the rows of what no sweep timed
    def unreached(
        self, result: BenchResult, planned: Sequence[Candidate], info: DeviceInfo
    ) -> list[Candidate]:
        """The planned candidates ``result``'s sweep did not reach that this device runs: not
        measured, for the budget; those it does not run get the row the sweep would have given
        them (unsupported: nothing to measure, so not something the budget prevented)."""
        seen = {r.candidate for r in result.rows}
        supported = []
        for cand in (c for c in planned if c not in seen):
            if support := self.framework.support(cand, info, self.workload):
                supported.append(cand)
            else:
                self._unmeasured(result, cand, Status.UNSUPPORTED, _why(support))
        return supported

    def unplanned(self, result: BenchResult, planned: Sequence[Candidate], info: DeviceInfo) -> None:
        """A row for each candidate the memory budget left no micro-batch (over-budget, or the
        failure that ended its memory search, an out-of-memory included), then one for each policy
        the plan leaves out, with why (unsupported, or not worth trying here): the table lists
        every policy tune was given; those it was not given are named once, in a note."""
        policies = {c.policy for c in planned}
        given = self.config.policy_names
        left_out = [n for n in POLICY_NAMES if n not in policies and n not in given]
        if left_out:
            said = "not tried, not among the policies tune was given (--policies)"
            self.notes.append(f"{said}: {', '.join(left_out)}")
        policies.update(left_out)
        if self.batches is not None:
            for cand, choice in self.batches.choices.items():
                if choice.micro_batch is None:
                    policies.add(cand.policy)
                    reason = choice.reason or f"no micro-batch dividing {self.batches.effective_batch} fits"
                    self._unmeasured(result, cand, choice.status, reason)
        for cand in (Candidate(n, framework=self.framework.name) for n in POLICY_NAMES if n not in policies):
            support = self.framework.support(cand, info, self.workload)
            why = ("not tried by tune: " if support else "") + _why(support)
            self._unmeasured(result, cand, Status.UNSUPPORTED, why)

    def _unmeasured(self, result: BenchResult, cand: Candidate, status: str, reason: str) -> None:
        """A row for ``cand`` that was not timed (unsupported, over the memory budget), saying why."""
        result.add(BenchRow(result.workload, cand, self.device, result.batch_size, status, reason))


class Search:
    """One tune from its speed sweep on: the sweep's rows (``result``, which every later stage adds
    to), the numerics checks and their verdicts, the prices the budget weighs, what was planned
    and not measured, the race. :meth:`start` runs the speed sweep; :meth:`run` the stages after."""

    def __init__(self, sweeps: Sweeps, result: BenchResult) -> None:
        self.sweeps, self.result = sweeps, result
        # what every stage reads (the notes: the list the steps before the sweep began)
        self.framework, self.budget = sweeps.framework, sweeps.budget
        self.notes, self.batches = sweeps.notes, sweeps.batches
        checkers: dict[int | None, Checker] = {}  # per micro-batch: the fp32 reference runs there
        self.costs = Costs(result, sweeps, checkers)
        self.checks = Checks(sweeps, self.costs, checkers)
        self.calibration = compiling.Calibration()
        self.race: Race | None = None
        self.untried: dict[Candidate, Untried] = {}  # planned, not measured (or only predicted)
        self.held = Held(self.budget)  # kept back from every stage to settle the pick's figure

    @classmethod
    def start(cls, sweeps: Sweeps, info: DeviceInfo) -> Search:
        """Stage 1, the speed sweep within ``SPEED_SHARE`` of the budget; a row for each policy
        the plan left out or the sweep did not reach, saying why."""
        with sweeps.phase("speed"):
            plan = sweeps.plan(info)
            share = sweeps.budget.share(SPEED_SHARE)
            search = cls(sweeps, sweeps.sweep(plan, share, finish_within=sweeps.past_share))
            if stopped := search.result.stopped:
                search.notes.append(f"speed sweep {stopped}")
                _cut_by_deadline(search.budget, search.result, f"the speed sweep {stopped}")
                search.not_measured(
                    sweeps.unreached(search.result, plan, info), f"not measured: the speed sweep {stopped}"
                )
            sweeps.unplanned(search.result, plan, info)
        return search

    def run(self, info: DeviceInfo, modes: Sequence[str]) -> tuple[Recommendation | None, list]:
        """The stages after the speed sweep in order (see the module docstring); the decision and
        its table."""
        phase = self.sweeps.phase
        with phase("numerics"):
            self.check_faster()
        with phase("speed"):
            self.finish_speed(info)
        with phase("numerics"):
            self.check_faster()  # the candidates measured late, if any beat strict fp32
        with phase("compile"):
            self.try_compile(modes, info)
        with phase("numerics"):
            # a compiled candidate its compile share could not check, with the whole budget: what
            # the user can run here is checked before any prediction for hardware they may lack
            # (a nanoGPT's bf16-true+compile-step, measured 2.50x, went unchecked while 49 s of the
            # budget predicted fp8 numerics on a CPU: issue 53)
            self.check_faster()
        with phase("race"):
            self.race_finalists()
        with phase("speed"):
            self.remeasure_noisy()
        rec, _ = self.decide()
        if rec is not None and self.sweeps.config.optimizers and not rec.candidate.compile_scope:
            with phase("speed"):  # the pick's optimizer implementations: same numerics, maybe faster
                self.try_optimizers(rec)
            rec, _ = self.decide()
        if rec is not None and self.batches is not None:
            with phase("speed"):
                self.try_smaller_batch(rec)
            rec, _ = self.decide()
        with phase("prediction"):  # rows and notes for hardware that runs them; they cannot change the pick
            predicted, notes = self.checks.predict(info)
            self.untried.update(predicted)
            self.notes += notes
        return self.decide()

    def decide(self) -> tuple[Recommendation | None, list]:
        config = self.sweeps.config
        return decide(
            self.result.rows,
            self.checks.verdicts,
            noise=config.noise,
            train_steps=config.train_steps,
            race=self.race,
            untried=list(self.untried.values()),
            not_checked=self.checks.not_checked,
            budget_s=config.budget_s,
            interrupted=self.budget.interrupted(),
        )

    def add(self, rows: Sequence[BenchRow]) -> list[BenchRow]:
        """Fold rows measured in another (paired) sweep into this one; the non-baseline ones (a
        candidate measured again replaces its row)."""
        added = [r for r in rows if r.candidate != self.sweeps.baseline]
        for row in added:
            self.result.update(row)
        return added

    def row(self, candidate: Candidate) -> BenchRow | None:
        """``candidate``'s row with its derived figures (None: not measured)."""
        return next((r for r in self.result.rows if r.candidate == candidate), None)

    def not_measured(self, candidates: Sequence[Candidate], why: str, cost_s: float | None = None) -> None:
        """Record ``candidates`` as planned but not measured because the budget ended (each a
        ``not-measured`` row of the decision table), with what measuring and checking each would
        cost: its measurement, plus a check where its numerics are not known yet."""
        families: set[Candidate] = set(self.checks.verdicts)
        for cand in candidates:
            cost = self.costs.measure_s() if cost_s is None else cost_s
            if cand.policy != "fp32" and cand.numerics not in families:
                cost += self.costs.check_s(cand.numerics, cand.micro_batch)
                families.add(cand.numerics)
            self.untried[cand] = Untried(cand, Status.NOT_MEASURED, why, round(cost, 1))

    # ------------------------------------------------------------------ 1. speed
    def finish_speed(self, info: DeviceInfo) -> None:
        """The candidates the speed sweep's share of the budget did not reach, and those a stalled
        step pruned that it left no time to retry, measured with the time the numerics checks left:
        the share is what the sweep may take first, not a cap."""
        again = {r.candidate: r for r in stalled(self.result.rows, self.sweeps.bench.prune_factor)}
        if not (self.result.stopped or again) or self.result.baseline is None:
            return  # without its strict-fp32 row nothing measured later has a reference
        first = f"speed sweep {self.result.stopped}" if self.result.stopped else None
        seen = {r.candidate for r in self.result.rows if r.candidate not in again}
        # a low format whose carrier already ran no faster than fp32 waits for the rest
        todo = after_slow_carriers([c for c in self.sweeps.plan(info) if c not in seen], self.result.rows)
        # (with less left than strict fp32's opening and one candidate, it would measure nothing)
        budget = self.costs.keeping_a_check(self.budget, todo, self.checks.verdicts)
        if not todo or not budget.can_pay(self.costs.opening_s() + self.costs.measure_s()):
            return
        more = self.sweeps.sweep(todo, budget, earlier=self.result.rows)
        added = self.add(
            [retried(again[r.candidate], r) if r.candidate in again else r for r in more.measured]
        )
        if first is not None:
            self.notes.remove(first)
            self.budget.restore(f"the {first}")
        late = [r.label for r in added if r.status not in (Status.UNSUPPORTED, Status.ERROR) and not r.spared]
        what = f"{', '.join(late)} measured later with the time the numerics checks left" if late else None
        said = "; ".join(part for part in (first, what) if part)
        if more.stopped:
            self.notes.append(f"{said or 'the late speed sweep'}; the rest of the sweep {more.stopped}")
            _cut_by_deadline(self.budget, more, f"the speed sweep {more.stopped}")
            why = f"not measured: the rest of the speed sweep {more.stopped}"
            self.not_measured(self.sweeps.unreached(self.result, todo, info), why)
            return
        self.result.stopped = self.result.baseline_ended = None
        if said:
            self.notes.append(said)

    # ------------------------------------------------------------------ 2. numerics
    def check_faster(self) -> None:
        """Check the candidates that beat strict fp32, fastest policy first; stop once one passed
        and nothing is left within ``RACE_WINDOW`` of it: each figure was divided by its own
        neighbouring fp32 rounds, so a candidate that close may still win the race (it must pass
        to run in it)."""
        verdicts = self.checks.verdicts
        faster = _faster(self.result.rows)
        passed = [r for r in faster if (v := verdicts.get(r.candidate.numerics)) and v.acceptable]
        best_pass: BenchRow | None = max(passed, key=speed) if passed else None  # from a first round

        def fastest(numerics: Candidate) -> BenchRow:
            return max((r for r in faster if r.candidate.numerics == numerics), key=speed)

        for numerics in dict.fromkeys(r.candidate.numerics for r in faster):
            if numerics in verdicts:
                continue
            top = fastest(numerics)
            if best_pass is not None and speed(top) < speed(best_pass) * (1 - RACE_WINDOW):
                break  # too slow to be a finalist: it cannot win
            race_s = self.costs.race_to_win_s(top, best_pass)
            cost = self.costs.row_check_s(top) + race_s
            # faster than any pass yet, its check decides the pick: the time kept to settle one is its
            decides = best_pass is None or speed(top) > speed(best_pass)
            (self.held.all_for if decides else self.held.tiebreak_for)(cost, self.budget)
            if not self.budget.can_pay(cost):
                left = [r.candidate.numerics for r in faster if r.candidate.numerics not in verdicts]
                why = self.checks.left_unchecked(
                    cost, race_s, {n: self.costs.row_check_s(fastest(n)) for n in left}
                )
                said = f"numerics of {numerics.label} not checked: "
                if not any(n.startswith(said) for n in self.notes):  # (said once, however often asked)
                    self.notes.append(said + why)
                    self.budget.cut(f"the numerics of {numerics.label} were not checked")
                break
            verdict = self.checks.check(numerics, micro_batch=top.candidate.micro_batch)
            if verdict.acceptable and decides:
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
        rescued = _rescued(verdict, faster)
        if self.batches is not None:  # the numerics key has no micro-batch: the measured one's
            rescued = [b for c in rescued if (b := self.batches.batched(c)) is not None]
        fix = (
            f"keep_fp32={verdict.fix_keep_fp32}"
            if verdict.fix_keep_fp32
            else f"keep_bf16={verdict.fix_keep_bf16}"
        )
        self.sweeps.stage(f"measuring rescued {base.label} with {fix}")
        measured = self.sweeps.sweep(rescued, self.budget).measured
        added = self.add([r for r in measured if r.candidate.keep_fp32 or r.candidate.keep_bf16])
        if not added:
            self.notes.append(f"rescued {base.label} not measured: {self.budget.unpaid()}")
            self.budget.cut(f"rescued {base.label} was not measured")
            return
        # The rescued candidate is judged as every candidate is (over the run: ranges, trends,
        # stalls), not taken from the search's verifying run.
        fixed = self.checks.check(rescued[0].numerics, fix=False, micro_batch=rescued[0].micro_batch)
        if fixed.passed:
            fixed.reason = cured(verdict, fixed)

    # ------------------------------------------------------------------ 3. beyond eager
    def try_compile(self, modes: Sequence[str], info: DeviceInfo) -> None:
        """Compiled variants chosen by what compiling can gain (:mod:`mixprec.tuning.compiling`):
        one per precision family first, most promising first (re-planned after each measurement
        recalibrates the prediction), each followed by its numerics check, then the other scopes
        while the budget pays. A candidate is compiled only if its prediction could reach the race;
        every attempt skipped is named with its predicted figure and why."""
        if not modes or self.decide()[0] is None:
            return
        budget = self.budget.share(1 - RACE_SHARE)  # what compiling may take: the race gets the rest
        costs, verdicts = self.costs, self.checks.verdicts
        skipped: dict[Candidate, str] = {}
        unraced: set[Candidate] = set()  # (skipped as too slow to win, not for want of time)
        while True:
            failed = {c for c, v in verdicts.items() if not v.acceptable}
            tried = {r.candidate for r in self.result.rows} | set(skipped)
            todo = compiling.plan(self.framework, self.result.rows, failed, modes, self.calibration)
            # (a scope this workload does not take: a script trained by a framework compiles through
            # that framework's switch, which compiles the model)
            todo = [a for a in todo if self.framework.support(a.candidate, info, self.sweeps.workload)]
            attempt = next((a for a in todo if a.candidate not in tried), None)
            if attempt is None:
                break
            candidate = attempt.candidate
            compile_s, priced, known = costs.compile_price(candidate, [a.candidate for a in todo])
            best = self.decide()[0]
            best_speed = (best.speedup_vs_fp32 or 1.0) if best is not None else 1.0
            predicted = f"predicted {attempt.speedup:.2f}x: {attempt.basis}; compile priced {priced}"
            # Predicted too far below the best to race, it cannot be the pick: its compile is budget
            # taken from one that could (fp32's family too, which needs no check). The default tune of
            # ResNet-50 on the EPYC spent 81 s compiling fp32+cl+compile-step, predicted 1.40x beside
            # a measured 2.00x, until the budget stopped it.
            if attempt.speedup < best_speed * (1 - RACE_WINDOW):
                unraced.add(candidate)
                skipped[candidate] = (
                    f"{candidate.label} (too far below the best {best_speed:.2f}x to race; {predicted})"
                )
                continue
            cost_s = costs.compile_and_check_s(candidate, compile_s, known)
            if self.held.tiebreak_for(cost_s, budget):
                budget = self.budget.share(1 - RACE_SHARE)
            if not budget.can_pay(cost_s):
                stop = budget.interrupted()
                unpaid = INTERRUPTED if stop else "the budget could not pay"
                skipped[candidate] = f"{candidate.label} ({unpaid}; {predicted})"
                why = f"not compiled: {unpaid}{'' if stop else ' for its compile and check'} ({predicted})"
                self.not_measured([candidate], why, costs.measure_compiled_s(compile_s))
                continue
            self.sweeps.stage(f"compiling {candidate.label}: {predicted}")
            swept = self.sweeps.sweep([candidate], budget)
            row = next((r for r in self.add(swept.measured) if r.candidate == candidate), None)
            if row is None:
                # Only its own session's time, and only where the budget stopped it: the sweep
                # opened strict fp32 first, and a sweep stopped before it began compiled nothing.
                if swept.stopped == stopped_measuring(candidate, budget.ended_by()):
                    costs.cut_off(candidate, clock.now() - self.sweeps.started[candidate.label])
                by = what_ended(budget.interrupted())
                skipped[candidate] = f"{candidate.label} ({by} while it compiled)"
                why = f"not measured: {by} while it compiled ({predicted})"
                self.not_measured([candidate], why, costs.measure_compiled_s(compile_s))
                continue
            if row.status != Status.OK:
                continue
            costs.compiled(row)
            self.calibration.update(attempt, row)
            if note := compiling.graph_note(row):
                self.notes.append(note)
            if candidate.numerics not in verdicts and budget.can_pay(costs.row_check_s(row)):
                self.checks.check(candidate.numerics, micro_batch=candidate.micro_batch)
        if skipped:
            raise_it = "" if self.budget.interrupted() else " (--budget raises the budget)"
            self.notes.append(f"not compiled: {'; '.join(skipped.values())}{raise_it}")
            cut = [c for c in skipped if c not in unraced]
            if cut:  # (fp32's compiles alone cannot have kept a lower precision from the pick)
                fp32_only = all(c.policy == "fp32" for c in cut)
                self.budget.cut("compiled candidates were not measured", fp32_only=fp32_only)

    def try_optimizers(self, rec: Recommendation) -> None:
        """The pick with its optimizer's other implementations (for-loop / foreach / fused): same
        numerics, possibly faster steps. Only the ones the optimizer class offers."""
        if rec.candidate.optimizer:
            return
        todo = self.framework.optimizer_variants(self.sweeps.workload, rec.candidate)
        cost_s = self.costs.variants_s(rec.candidate, len(todo))
        # a faster implementation would be the pick: it takes the tie-break's time first
        if todo and not (self.budget.can_pay(cost_s) or self.held.tiebreak_for(cost_s, self.budget)):
            said = f"the optimizer's implementations of {rec.label} not measured: {self.budget.unpaid()}"
            self.notes.append(said)
            return
        if todo:
            self.sweeps.stage(
                f"measuring the optimizer's implementations: {', '.join(c.label for c in todo)}"
            )
            self.add(self.sweeps.sweep(todo, self.budget).measured)

    def try_smaller_batch(self, rec: Recommendation) -> None:
        """The pick one micro-batch down (``tune --batch auto``): a cache-bound step can be faster
        there, and then it is the pick and the next size down is measured too; where it is as fast
        within the noise, a note says so (the knee: the same speed with less memory). The grid of
        sizes is never timed whole."""
        if self.batches is None:
            return
        current, noise = rec.candidate, self.sweeps.config.noise
        while (smaller := self.batches.smaller(current)) is not None:
            if not self.budget.can_pay(self.costs.opening_s() + self.costs.sweep_s()):
                self.notes.append(f"{smaller.label} not measured: {self.budget.unpaid()}")
                return
            self.sweeps.stage(f"measuring the pick one micro-batch down: {smaller.label}")
            rows = self.add(self.sweeps.sweep([smaller], self.budget).measured)
            picked, _ = self.decide()
            if picked is not None and picked.candidate == smaller:
                current = smaller
                continue
            row = next((r for r in rows if r.candidate == smaller and r.status == Status.OK), None)
            mine = self.row(current)
            if row is not None and mine is not None and speed(row) >= speed(mine) * (1 - noise):
                self.notes.append(
                    f"{smaller.label} is within {noise:.0%} of {current.label}'s speed "
                    f"({speed(row):.2f}x against {speed(mine):.2f}x) with a smaller micro-batch: "
                    "the throughput has flattened there"
                )
            return

    # ------------------------------------------------------------------ 4. the race
    def race_finalists(self) -> None:
        """The finalists measured against each other (:mod:`mixprec.measure.race`): the fastest
        passing candidate and up to ``RACE_RIVALS`` others within ``RACE_WINDOW`` of it, each
        paired with the leader itself until their difference is resolved, measured to be a tie
        within the noise floor, or the budget ends it."""
        rec, table = self.decide()
        if rec is None:
            return
        finalists = _finalists(table, self.result.baseline, self.sweeps.config.train_steps)
        if not finalists:
            return
        leader, rivals, cost_s = finalists[0], finalists[1:], self.costs.race_s(finalists)
        self.held.tiebreak_for(cost_s(len(rivals), FIRST_ROUNDS), self.budget)
        self.sweeps.stage(f"racing {', '.join(r.label for r in rivals)} against {leader.label}")
        self.race = race(
            leader.candidate,
            [r.candidate for r in rivals],
            self.sweeps.racing(self.result.batch_size),
            noise=self.sweeps.config.noise,
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
        rec = self.decide()[0]
        if rec is None or not rec.remeasure:
            return
        steps = 2 * self.sweeps.bench.steps
        for i, cand in enumerate(rec.remeasure):
            old = self.row(cand)
            if old is None:
                continue  # nothing measured to replace
            if not self.budget.can_pay(self.costs.remeasure_s(cand)) and self.held.seconds:
                # a rival that may beat the pick before the pick's figure settled: bench_vs_tune's
                # run 9 picked bf16-mixed (1.58x), bf16-mixed+cl 1.91x +-33% left not re-measured
                self.held.release()
            if not self.budget.can_pay(self.costs.remeasure_s(cand)):
                self.notes.append(f"{cand.label} not re-measured: {self.budget.unpaid()}")
                left = rec.remeasure[i:]  # (this one and every one after it: a lower precision among them?)
                said = f"{', '.join(c.label for c in left)}, too noisy to rank, not re-measured"
                self.budget.cut(said, fp32_only=all(c.policy == "fp32" for c in left))
                return
            self.sweeps.stage(f"re-measuring {cand.label}: too noisy to rank")
            measured = self.sweeps.sweep([cand], self.budget, steps=steps).measured
            row = next((r for r in measured if r.candidate == cand), None)
            if row is None or row.status != Status.OK:
                self.notes.append(f"{cand.label} not re-measured: {row.reason if row else 'budget spent'}")
                continue
            note = _remeasured(old, steps)
            self.result.update(replace(row, notes=(*row.notes, note)))
            self.notes.append(f"{cand.label} {note}")


# ---------------------------------------------------------------------- after the pick
def complete(
    search: Search, rec: Recommendation, *, lint: bool
) -> tuple[Recommendation, list[dict[str, Any]] | None]:
    """The pick whole: the micro-batch and accumulation it trains with, its measured peak memory,
    the lint findings worth fixing under it; the notes about its batch and its compute share.
    With ``lint`` (and budget left), the backend's findings under the pick, whole (layout and
    fp32 islands included), returned beside it (None: not linted)."""
    sweeps, plan, budget = search.sweeps, search.batches, search.budget
    row = search.row(rec.candidate)
    findings = _lint(sweeps, rec.candidate) if lint and budget.elapsed() < budget.seconds else None
    measured = plan.peak(rec.candidate) if plan is not None else None
    if plan is not None:
        # a torch workload's model: its BatchNorm statistics follow the micro-batch
        model = getattr(sweeps.workload, "model", None)
        batch_norm = isinstance(model, torch.nn.Module) and bool(batch_norm_layers(model))
        search.notes += batching.notes(plan, sweeps.framework.default_batch_size(sweeps.workload), batch_norm)
    if row is not None and (note := _compute_share(rec, row)):
        search.notes.append(note)
    whole = replace(
        rec,
        micro_batch=rec.candidate.micro_batch or sweeps.bench.batch_size,
        accumulation_steps=rec.candidate.accumulation_steps,
        peak_memory_bytes=measured if measured is not None else (row.peak_memory_bytes if row else None),
        lint_worth_fixing=[
            f
            for f in findings or []
            if f.get("severity") in ("warning", "error") and not _layout_measured(search.result, rec, f)
        ][:5],
    )
    return whole, findings


def _lint(sweeps: Sweeps, pick: Candidate) -> list[dict[str, Any]] | None:
    """The backend's lint findings under ``pick``; None, with a note, where lint fails: it is advice,
    and its failure must not lose the recommendation."""
    try:
        return sweeps.framework.lint(sweeps.workload, pick, sweeps.device)
    except Exception as exc:
        sweeps.notes.append(f"lint failed: {type(exc).__name__}: {exc}")
        return None


def _layout_measured(result: BenchResult, rec: Recommendation, finding: dict[str, Any]) -> bool:
    """Whether lint ``finding`` is a layout change this tune measured on the pick: the table holds
    the answer, so it is not advice. `make demo` recommended bf16-mixed over bf16-mixed+cl
    ("within measurement noise") and then advised channels_last under the pick."""
    fix = finding.get("mechanical_fix") or {}
    if fix.get("kind") != "layout":
        return False
    other = replace(rec.candidate, channels_last=bool(fix.get("channels_last")))
    return any(r.candidate == other and r.status in (Status.OK, Status.PRUNED) for r in result.rows)


def _why(support: Support) -> str:
    """Why a candidate is not supported (or not tried) here, and what to try instead."""
    return support.reason + (f"; try {support.suggestion}" if support.suggestion else "")


def fastest_row(rows: Sequence[BenchRow]) -> BenchRow | None:
    """The fastest row measured over paired rounds: the one settling the pick's figure is priced
    for before the pick is known."""
    return max((r for r in rows if r.status == Status.OK and r.paired_ratios), key=speed, default=None)


def _faster(rows: Sequence[BenchRow]) -> list[BenchRow]:
    """The lower-precision rows measured faster than strict fp32, fastest first."""
    faster = [
        r
        for r in rows
        if r.status == Status.OK and r.policy != "fp32" and not r.baseline_repeat and speed(r) > 1.0
    ]
    return sorted(faster, key=lambda r: -speed(r))


def _rescued(verdict: CandidateCheck, faster: Sequence[BenchRow]) -> list[Candidate]:
    """The failing candidate of ``verdict`` with the keep_fp32 set (or precision map) its check
    found, in each layout it was measured in."""
    base = verdict.candidate
    return [
        replace(
            base,
            channels_last=cl,
            keep_fp32=(*base.keep_fp32, *verdict.fix_keep_fp32),
            keep_bf16=(*base.keep_bf16, *verdict.fix_keep_bf16),
        )
        for cl in sorted({r.channels_last for r in faster if r.candidate.numerics == base})
    ]


def _finalists(table: Sequence[Ranked], base: BenchRow | None, train_steps: int) -> list[BenchRow]:
    """The race's leader and rivals: the fastest passing candidate (its compile amortised over
    ``train_steps``) and up to ``RACE_RIVALS`` others within ``RACE_WINDOW`` of it, or of the low
    end of its interval where it has one (a noisy figure far ahead is the duel's to settle: the
    nanoGPT's bf16-true+compile-step on the AMX Xeon read 3.47x [1.46-7.20], so bf16-true at 2.10x
    raced nothing, and the leader was then set aside as too noisy to rank, bf16-true picked
    unraced; in bench, the pair read 2.50x and 2.15x), strict fp32 only within the window of its
    figure; none without a rival."""
    passing = [  # a noisy candidate races too: a duel with the leader resolves it
        r.row
        for r in table
        if r.status in (Status.PASS, Status.RECOMMENDED, Status.NOISY, Status.INCONCLUSIVE)
        and r.row is not None
    ]

    def effective(row: BenchRow) -> float:
        return amortized(row, base, train_steps)

    passing.sort(key=effective, reverse=True)
    if len(passing) < 2:
        return []
    leader = passing[0]
    low = effective(leader)
    if leader.speedup_ci and speed(leader):  # (the same share of its amortised figure)
        low *= min(1.0, leader.speedup_ci[0] / speed(leader))

    def rival(row: BenchRow) -> bool:
        # (strict fp32 against a noisy leader is the leader's own figure again: a re-measure's)
        if base is not None and row.candidate == base.candidate:
            return effective(row) >= effective(leader) * (1 - RACE_WINDOW)
        return effective(row) >= low * (1 - RACE_WINDOW)

    rivals = [r for r in passing[1:] if rival(r)][:RACE_RIVALS]
    return [leader, *rivals] if rivals else []


def _remeasured(old: BenchRow, steps: int) -> str:
    """The note on a row measured again with ``steps`` paired rounds: what the first one said."""
    first = f"{old.speedup_vs_fp32 or 0:.2f}x"
    if old.speedup_ci:
        first += f" [{old.speedup_ci[0]:.2f}-{old.speedup_ci[1]:.2f}]"
    return f"re-measured with {steps} paired rounds: the first measurement ({first}) was too noisy to rank"


def _compute_share(rec: Recommendation, row: BenchRow) -> str | None:
    """Where the next gain is when the pick spends most of its step outside matmuls."""
    share = row.compute_share
    if share is None or share >= LOW_COMPUTE_SHARE:
        return None
    hint = "" if rec.candidate.compile else "; compiling fuses the elementwise rest"
    return (
        f"{rec.label} spends {share:.0%} of its profiled step in matmul/conv/attention: lower "
        f"precision speeds up only that share, the rest is elementwise ops, the optimizer and "
        f"framework overhead{hint}"
    )


def _cut_by_deadline(budget: Budget, sweep: BenchResult, what: str) -> None:
    """``what`` cut by the budget, unless the sweep stopped because strict fp32's session ended: a
    crash is no reason to raise --budget."""
    if not sweep.baseline_ended:
        budget.cut(what)
