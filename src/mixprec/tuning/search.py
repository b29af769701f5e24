"""The state and the stages of one tune (:func:`mixprec.tuning.run.tune` runs them in order).

1. Speed: the backend's tune plan (every supported policy x layout, eager), paired with strict
   fp32 (hopeless ones pruned), first within ``SPEED_SHARE`` of the budget; what that share did
   not reach is measured after the numerics checks with the time they left.
2. Numerics: the candidates that beat strict fp32, fastest first; a failing one may be rescued by
   a keep_fp32 set, which is then measured at its real cost.
3. Beyond eager: the best passing candidates again compiled (``torch.compile``, XLA; and their
   numerics, since fused kernels round differently), and the pick with the optimizer's other
   implementations. Compilation is paid once: candidates are compared over ``train_steps``.
4. Decide (:func:`mixprec.tuning.decide.decide`); when the pick ties with a faster candidate
   within noise, or cannot be told apart from it, and budget is left: re-measure both, decide again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mixprec.budget import Budget
from mixprec.checking.check import Checker, check, make_checker
from mixprec.events import Event, Events
from mixprec.frameworks import Framework
from mixprec.hardware.device import DeviceInfo
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.measure.sweep import bench
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.policy import POLICY_NAMES, Candidate
from mixprec.status import Status
from mixprec.tuning.decide import Recommendation, decide, noise_band, speed, within_noise

# Share of the budget the eager speed sweep takes first; numerics, compile and rescues get the
# rest, and what the sweep did not reach is measured after the numerics checks if time is left.
SPEED_SHARE = 0.45
# Seconds kept back at the end for deciding, linting and writing.
RESERVE_S = 10.0
# How many of the best eager candidates are measured again compiled.
COMPILE_TOP = 2
# What a compile is assumed to cost before the first one was timed (ResNet-50 and a small GPT
# took 18-45 s each on a 2-core CPU; Keras' XLA about as long).
MIN_COMPILE_S = 20.0
# More graph breaks than this and a compiled candidate's row says so.
GRAPH_BREAKS_NOTED = 0
# Below this share of step time in matmul/conv/attention, precision is not where the time goes.
LOW_COMPUTE_SHARE = 0.5
# The run length compile time is amortised over when the user names none.
TRAIN_STEPS = 10_000
# Re-measuring a tie costs what its paired rounds take, times this (warm-up, process start).
REMEASURE_MARGIN = 1.5


class Search:
    """The state of one tune: the backend, the sweep's rows, the verdicts, the shared fp32
    checker, the budget and the event stream."""

    def __init__(
        self,
        workload: Any,
        framework: Framework,
        device: str,
        sweep: dict[str, Any],
        *,
        check_steps: int,
        fix: bool,
        noise: float,
        train_steps: int,
        budget: Budget,
        events: Events,
    ) -> None:
        self.workload, self.framework, self.device, self.sweep = workload, framework, device, sweep
        self.check_steps, self.fix, self.noise, self.train_steps = check_steps, fix, noise, train_steps
        self.budget, self.events = budget, events
        self.notes: list[str] = []
        self.verdicts: dict[Candidate, CandidateCheck] = {}
        self.checked: CheckResult | None = None
        self._checker: Checker | None = None
        self.result: BenchResult | None = None

    def stage(self, text: str) -> None:
        self.events({"event": "stage", "text": text})

    def decide(self) -> tuple[Recommendation | None, list]:
        assert self.result is not None
        return decide(self.result.rows, self.verdicts, noise=self.noise, train_steps=self.train_steps)

    def _bench(self, candidates: Sequence[Candidate], budget: Budget, **overrides: Any) -> BenchResult:
        def on_bench(event: Event) -> None:
            if event["event"] == "candidate":
                self.stage(f"measuring {event['label']} ({event['index'] + 1}/{event['count']})")
            elif event["event"] in ("row", "output", "step"):
                self.events(event)

        return bench(
            self.workload,
            candidates=candidates,
            events=on_bench,
            budget=budget,
            **{**self.sweep, **overrides},
        )

    def _add(self, rows: Sequence[BenchRow]) -> list[BenchRow]:
        """Fold rows measured in another (paired) sweep into this one; the non-baseline ones."""
        assert self.result is not None
        added = [r for r in rows if r.candidate != self.framework.baseline]
        for row in added:
            self.result.add(row)
        return added

    # ------------------------------------------------------------------ 1. speed
    def plan(self, info: DeviceInfo) -> list[Candidate]:
        return [self.framework.validate(c) for c in self.framework.tune_candidates(self.workload, info)]

    def measure_speed(self, info: DeviceInfo) -> None:
        plan = self.plan(info)
        self.result = self._bench(plan, self.budget.share(SPEED_SHARE))
        if self.result.stopped:
            self.notes.append(f"speed sweep {self.result.stopped}")
            self.budget.cut(f"the speed sweep {self.result.stopped}")
        self._not_planned(info, {c.policy for c in plan})

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
            self.result.add(
                BenchRow(
                    self.result.workload,
                    cand,
                    self.device,
                    self.result.batch_size,
                    Status.UNSUPPORTED,
                    ("not tried by tune: " if support else "") + why,
                )
            )

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
        more = self._bench(todo, self.budget)
        added = self._add(more.measured)
        self.notes.remove(first)
        self.budget.restore(f"the {first}")
        late = [r.label for r in added if r.status not in (Status.UNSUPPORTED, Status.ERROR)]
        what = f"; {', '.join(late)} measured later with the time the numerics checks left" if late else ""
        if more.stopped:
            self.notes.append(f"{first}{what}; the rest of the sweep {more.stopped}")
            self.budget.cut(f"the speed sweep {more.stopped}")
            return
        self.result.stopped = None
        self.notes.append(f"{first}{what}")

    # ------------------------------------------------------------------ 2. numerics
    def check_cost_s(self) -> float:
        """About what checking one more candidate costs: its training run and first-step probe,
        plus the fp32 reference and chaos-floor runs when no check has run yet, each a little
        slower than a measured fp32 step (deep copies, hooks)."""
        assert self.result is not None
        base = self.result.baseline
        step_s = base.step_time_ms.median_ms / 1e3 if base is not None and base.step_time_ms else 1.0
        runs = 1 if self._checker is not None else 3
        return 2.0 * runs * (self.check_steps + 2) * step_s

    def check(self, candidate: Candidate) -> CandidateCheck:
        if self._checker is None:
            self._checker = make_checker(
                self.workload,
                steps=self.check_steps,
                batch_size=self.sweep["batch_size"],
                device=self.device,
                events=self.events,
                budget=self.budget,
            )
        self.stage(f"checking numerics of {candidate.label}")
        res = check(
            self.workload, policies=[candidate], fix=self.fix, checker=self._checker, events=self.events
        )
        if self.checked is None:
            self.checked = res
        else:
            self.checked.candidates.extend(res.candidates)
        verdict = res.candidates[0]
        self.verdicts[candidate] = verdict
        return verdict

    def check_faster(self) -> None:
        """Check the candidates that beat strict fp32, fastest policy first; stop once one passed
        and nothing faster is left within noise of it."""
        assert self.result is not None
        faster = sorted(
            (
                r
                for r in self.result.rows
                if r.status == Status.OK and r.policy != "fp32" and not r.baseline_repeat and speed(r) > 1.0
            ),
            key=lambda r: -speed(r),
        )
        passed = [r for r in faster if (v := self.verdicts.get(r.candidate.numerics)) and v.passed]
        best_pass: BenchRow | None = max(passed, key=speed) if passed else None  # from a first round
        for numerics in dict.fromkeys(r.candidate.numerics for r in faster):
            if numerics in self.verdicts:
                continue
            top = max((r for r in faster if r.candidate.numerics == numerics), key=speed)
            if best_pass is not None and not within_noise(
                speed(top), speed(best_pass), noise_band(top, best_pass, self.noise)
            ):
                break  # slower than a passing candidate by more than the noise: cannot win
            if not self.budget.can_pay(self.check_cost_s()):
                self.notes.append(
                    f"numerics of {numerics.label} not checked: budget spent (--budget raises it)"
                )
                self.budget.cut(f"the numerics of {numerics.label} were not checked")
                break
            verdict = self.check(numerics)
            if verdict.passed and (best_pass is None or speed(top) > speed(best_pass)):
                best_pass = top
            elif verdict.fix_keep_fp32 and verdict.fix_verified and not self.budget.expired():
                self.rescue(faster, verdict)

    def rescue(self, faster: list[BenchRow], verdict: CandidateCheck) -> None:
        """Measure a failing policy rescued by keep_fp32 (fp32 islands are not free); its verdict is
        built from the verifying run's figures."""
        base = verdict.candidate
        layouts = sorted({r.channels_last for r in faster if r.candidate.numerics == base})
        rescued = [
            replace(base, channels_last=cl, keep_fp32=(*base.keep_fp32, *verdict.fix_keep_fp32))
            for cl in layouts
        ]
        self.stage(f"measuring rescued {base.label} with keep_fp32={verdict.fix_keep_fp32}")
        added = self._add([r for r in self._bench(rescued, self.budget).measured if r.keep_fp32])
        if not added:
            self.notes.append(f"rescued {base.label} not measured: budget spent")
            self.budget.cut(f"rescued {base.label} was not measured")
            return
        metrics: dict[str, Any] = {
            k: v for k, v in verdict.fix_metrics.items() if k in CandidateCheck.__dataclass_fields__
        }
        fixed = replace(
            verdict, **metrics, candidate=rescued[0].numerics, verdict=Status.PASS, reason=verdict.fix_note
        )
        self.verdicts[fixed.candidate] = fixed

    def predict(self, info: DeviceInfo) -> None:
        """Candidates the device cannot run fast but whose numerics can be computed here (fp8 on a
        CPU through torchao's recipe): say whether they would pass, a labelled prediction, never a
        measured speed."""
        predicted, notes = self.framework.predictions(self.workload, info)
        self.notes += notes
        for cand in predicted:
            if not self.budget.can_pay(self.check_cost_s()):
                self.notes.append(f"{cand.label} numerics not predicted: budget spent (--budget raises it)")
                return
            verdict = self.check(cand)
            outcome = "would pass" if verdict.passed else "would fail"
            self.notes.append(
                f"{cand.label} {outcome} the numerics check on an {cand.spec.compute_format} GPU "
                f"({verdict.reason}); {verdict.predicted or 'predicted here, speed not measured'}"
            )

    # ------------------------------------------------------------------ 3. beyond eager
    def try_compile(self, modes: Sequence[str]) -> None:
        """The best passing eager candidates again compiled, one at a time, fastest first, each
        followed by its numerics check; stops when the budget cannot pay for the next (estimated
        from the compile time seen so far)."""
        assert self.result is not None
        rec, _ = self.decide()
        if rec is None or not modes:
            return
        passing = [
            r
            for r in self.result.rows
            if r.status == Status.OK
            and not r.candidate.compile
            and not r.candidate.optimizer
            and (
                r.policy == "fp32"
                or ((v := self.verdicts.get(r.candidate.numerics)) is not None and v.passed)
            )
        ]
        best = sorted(passing, key=speed, reverse=True)[:COMPILE_TOP]
        todo = [replace(r.candidate, compile=mode) for r in best for mode in modes]
        todo = [c for c in todo if not any(r.candidate == c for r in self.result.rows)]
        compile_s = MIN_COMPILE_S
        for n, candidate in enumerate(todo):
            # measuring it compiles once, checking it compiles again: pay for both
            if not self.budget.can_pay(2 * compile_s + self.check_cost_s()):
                skipped = ", ".join(c.label for c in todo[n:])
                self.notes.append(f"not compiled within the budget: {skipped} (--budget raises it)")
                return
            self.stage(f"compiling {candidate.label}")
            measured = self._add(self._bench([candidate], self.budget).measured)
            row = next((r for r in measured if r.candidate == candidate), None)
            if row is None:
                self.notes.append(f"{candidate.label}: not measured within the budget")
                return
            if row.status != Status.OK:
                continue
            compile_s = max(compile_s, row.compile_s or 0.0)
            if row.graph_breaks and row.graph_breaks > GRAPH_BREAKS_NOTED:
                self.notes.append(
                    f"{row.label}: {row.graph_breaks} graph breaks; each one splits the compiled graph and "
                    "stops fusion across it (torch._dynamo.explain(model)(batch) lists where and why)"
                )
            if candidate.numerics not in self.verdicts and self.budget.can_pay(
                compile_s + self.check_cost_s()
            ):
                self.check(candidate.numerics)

    def try_optimizers(self, rec: Recommendation) -> None:
        """The pick with its optimizer's other implementations (for-loop / foreach / fused): same
        numerics, possibly faster steps. Only the ones the optimizer class offers."""
        if rec.candidate.optimizer or not self.budget.can_pay(10):
            return
        todo = self.framework.optimizer_variants(self.workload, rec.candidate)
        if todo:
            self.stage(f"measuring the optimizer's implementations: {', '.join(c.label for c in todo)}")
            self._add(self._bench(todo, self.budget).measured)

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

    # ------------------------------------------------------------------ 4. ties
    def remeasure(self, rec: Recommendation) -> bool:
        """Time the pick and the one it tied with (or could not be separated from) again, twice as
        long, and fold the new paired rounds into both rows. False when the budget cannot pay."""
        assert self.result is not None
        rows = {r.candidate: r for r in self.result.rows if r.status == Status.OK and not r.baseline_repeat}
        other = rec.tied_with or rec.noisy_with
        if other not in rows or rec.candidate not in rows:
            return False
        chosen, rival = rows[rec.candidate], rows[other]
        base = self.result.baseline
        steps = 2 * self.sweep["steps"]
        # bench times fp32 next to every candidate: pay for it too
        cost = sum(
            (self.sweep["warmup"] + 2 * steps) * (r.step_time_ms.median_ms / 1e3)
            for r in (chosen, rival, base)
            if r is not None and r.step_time_ms
        )
        if not self.budget.can_pay(REMEASURE_MARGIN * cost):
            self.notes.append(f"{chosen.label} and {rival.label}: no budget left to re-measure them")
            return False
        self.stage(f"re-measuring {chosen.label} and {rival.label}: within noise of each other")
        again = self._bench([chosen.candidate, rival.candidate], self.budget, steps=steps)
        extra = {r.candidate: r for r in again.measured if r.status == Status.OK}
        redone = [row for row in (chosen, rival) if row.candidate in extra]
        for row in redone:
            new = extra[row.candidate]
            self.result.update(
                replace(
                    row,
                    step_times_ms=row.step_times_ms + new.step_times_ms,
                    paired_ratios=row.paired_ratios + new.paired_ratios,
                )
            )
        if not redone:
            self.notes.append("re-measurement of the tie stopped by the budget")
            return False
        self.notes.append(
            f"{chosen.label} and {rival.label} were within noise of each other: "
            f"{' and '.join(r.label for r in redone)} re-measured with {steps} more paired rounds each"
        )
        return True

    # ------------------------------------------------------------------ after the pick
    def lint(self, rec: Recommendation) -> list[dict[str, Any]] | None:
        """The backend's lint findings under the pick, whole (layout and fp32 islands included)."""
        try:
            return self.framework.lint(self.workload, rec.candidate, self.device)
        except Exception as exc:  # lint is advice: its failure must not lose the recommendation
            self.notes.append(f"lint failed: {type(exc).__name__}: {exc}")
            return None
