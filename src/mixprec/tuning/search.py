"""`tune`: the fastest configuration that trains correctly, with the evidence.

1. Speed: every supported policy x layout, eager, paired with strict fp32 (hopeless ones pruned),
   first within ``SPEED_SHARE`` of the budget; what that share did not reach is measured after
   the numerics checks with the time they left.
2. Numerics: the candidates that beat strict fp32, fastest first; a failing one may be rescued by
   a keep_fp32 set, which is then measured at its real cost.
3. Beyond eager: the best passing candidates again under ``torch.compile`` (and their numerics,
   since fused kernels round differently), and the pick with the optimizer's foreach/fused
   implementations. Compilation is paid once: candidates are compared over ``train_steps``.
4. Decide (:func:`mixprec.tuning.decide.decide`); when the pick ties with a faster candidate
   within noise, or cannot be told apart from it, and budget is left: re-measure both, decide again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import torch

from mixprec.errors import UsageError
from mixprec.hardware import environment
from mixprec.hardware.device import DeviceInfo, detect, resolve_device
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.measure.sweep import bench, has_4d_weights
from mixprec.numerics.check import check, make_checker
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.policy import POLICY_NAMES, Candidate, check_support
from mixprec.policy.support import fp8_predictable
from mixprec.status import Status
from mixprec.tuning.decide import Recommendation, decide, noise_band, speed, within_noise
from mixprec.tuning.result import TuneResult
from mixprec.workload import Workload, validate_workload

Progress = Callable[[str], None]
Events = Callable[[dict[str, Any]], None]
# Share of the budget the eager speed sweep takes first; numerics, compile and rescues get the
# rest, and what the sweep did not reach is measured after the numerics checks if time is left.
SPEED_SHARE = 0.45
# Seconds kept back at the end for deciding, linting and writing.
RESERVE_S = 10.0
# How many of the best eager candidates are measured again under torch.compile.
COMPILE_TOP = 2
# What a compile is assumed to cost before the first one was timed (ResNet-50 and a small GPT
# took 18-45 s each on a 2-core CPU).
MIN_COMPILE_S = 20.0
# More graph breaks than this and a compiled candidate's row says so.
GRAPH_BREAKS_NOTED = 0
# Below this share of step time in matmul/conv/attention, precision is not where the time goes.
LOW_COMPUTE_SHARE = 0.5
# The run length compile time is amortised over when the user names none.
TRAIN_STEPS = 10_000


def tune_candidates(info: DeviceInfo, has_4d: bool) -> list[Candidate]:
    """Every supported policy in every useful layout; unsupported ones once, so the table says why."""
    layouts = (False, True) if has_4d else (False,)
    return [
        Candidate(p, cl) for p in POLICY_NAMES for cl in (layouts if check_support(p, info) else (False,))
    ]


class _Search:
    """The state of one tune: the sweep's rows, the verdicts, the shared fp32 checker, the clock."""

    def __init__(
        self,
        workload: Workload,
        device: torch.device,
        sweep: dict[str, Any],
        *,
        check_steps: int,
        fix: bool,
        noise: float,
        train_steps: int,
        deadline: float,
        say: Progress,
        events: Events,
    ) -> None:
        self.workload, self.device, self.sweep = workload, device, sweep
        self.check_steps, self.fix, self.noise, self.train_steps = check_steps, fix, noise, train_steps
        self.deadline, self.say, self.events = deadline, say, events
        self.notes: list[str] = []
        # What the budget cut that could have changed the pick (a candidate not measured or not
        # checked); a pick of strict fp32 with something cut is "budget exhausted", not a verdict.
        self.cut: list[str] = []
        self.verdicts: dict[Candidate, CandidateCheck] = {}
        self.checked: CheckResult | None = None
        self._checker: Any = None
        self.result: BenchResult | None = None

    def time_left(self) -> float:
        return self.deadline - RESERVE_S - time.perf_counter()

    def decide(self) -> tuple[Recommendation | None, list]:
        assert self.result is not None
        return decide(self.result.rows, self.verdicts, noise=self.noise, train_steps=self.train_steps)

    def _bench(self, candidates: Sequence[Candidate], deadline: float, **overrides: Any) -> BenchResult:
        def on_bench(event: dict[str, Any]) -> None:
            if event["event"] == "candidate":
                self.say(f"measuring {event['label']} ({event['index'] + 1}/{event['count']})")
            if event["event"] in ("row", "output"):
                self.events(event)

        return bench(
            self.workload,
            candidates=candidates,
            progress=on_bench,
            deadline=deadline,
            **{**self.sweep, **overrides},
        )

    # ------------------------------------------------------------------ 1. speed
    def measure_speed(self, info: DeviceInfo, deadline: float) -> None:
        self.result = self._bench(tune_candidates(info, has_4d_weights(self.workload.model)), deadline)
        if self.result.stopped:
            self.notes.append(f"speed sweep {self.result.stopped}")
            self.cut.append(f"the speed sweep {self.result.stopped}")

    def finish_speed(self, info: DeviceInfo) -> None:
        """The candidates the speed sweep's share of the budget did not reach, measured with the
        time the numerics checks left: the share is what the sweep may take first, not a cap."""
        assert self.result is not None
        if not self.result.stopped or self.result.baseline is None:
            return  # without its strict-fp32 row nothing measured later has a reference
        first = f"speed sweep {self.result.stopped}"
        seen = {r.candidate for r in self.result.rows}
        todo = [c for c in tune_candidates(info, has_4d_weights(self.workload.model)) if c not in seen]
        if not todo or self.time_left() <= 0:
            return
        more = self._bench(todo, self.deadline - RESERVE_S)
        added = self._add(more.measured)
        self.notes.remove(first)
        self.cut.remove(f"the {first}")
        late = [r.label for r in added if r.status not in (Status.UNSUPPORTED, Status.ERROR)]
        what = f"; {', '.join(late)} measured later with the time the numerics checks left" if late else ""
        if more.stopped:
            self.notes.append(f"{first}{what}; the rest of the sweep {more.stopped}")
            self.cut.append(f"the speed sweep {more.stopped}")
            return
        self.result.stopped = None
        self.notes.append(f"{first}{what}")

    def _add(self, rows: Sequence[BenchRow]) -> list[BenchRow]:
        """Fold rows measured in another (paired) sweep into this one; the non-baseline ones."""
        assert self.result is not None
        added = [r for r in rows if r.candidate != Candidate("fp32")]
        for row in added:
            self.result.add(row)
        return added

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
                progress=lambda m: self.say(f"checking {m}"),
                deadline=self.deadline - RESERVE_S,
            )
        self.say(f"checking numerics of {candidate.label}")
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
            if self.time_left() < self.check_cost_s():
                self.notes.append(
                    f"numerics of {numerics.label} not checked: budget spent (--budget raises it)"
                )
                self.cut.append(f"the numerics of {numerics.label} were not checked")
                break
            verdict = self.check(numerics)
            if verdict.passed and (best_pass is None or speed(top) > speed(best_pass)):
                best_pass = top
            elif verdict.fix_keep_fp32 and verdict.fix_verified and self.time_left() > 0:
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
        self.say(f"measuring rescued {base.label} with keep_fp32={verdict.fix_keep_fp32}")
        added = self._add([r for r in self._bench(rescued, self.deadline).measured if r.keep_fp32])
        if not added:
            self.notes.append(f"rescued {base.label} not measured: budget spent")
            self.cut.append(f"rescued {base.label} was not measured")
            return
        metrics: dict[str, Any] = {
            k: v for k, v in verdict.fix_metrics.items() if k in CandidateCheck.__dataclass_fields__
        }
        fixed = replace(
            verdict, **metrics, candidate=rescued[0].numerics, verdict=Status.PASS, reason=verdict.fix_note
        )
        self.verdicts[fixed.candidate] = fixed

    def predict_fp8(self, info: DeviceInfo) -> None:
        """On a device without fp8 tensor cores, compute the fp8 policies' numerics anyway (torchao's
        recipe runs everywhere, slowly) and say whether they would pass on an fp8 GPU: a labelled
        prediction, never a measured speed."""
        from mixprec.policy.fp8 import fp8_layers

        names = [n for n in POLICY_NAMES if fp8_predictable(n, info)]
        if not names:
            return
        converted, left = fp8_layers(self.workload.model)
        if not converted:
            self.notes.append(
                f"fp8 would convert none of this model's Linear layers ({len(left)} have a dimension not "
                "divisible by 16, which torch._scaled_mm needs): nothing to predict"
            )
            return
        for name in names:
            if self.time_left() < self.check_cost_s():
                self.notes.append(f"{name} numerics not predicted: budget spent (--budget raises it)")
                return
            verdict = self.check(Candidate(name))
            outcome = "would pass" if verdict.passed else "would fail"
            self.notes.append(
                f"{name} {outcome} the numerics check on an fp8 GPU ({verdict.reason}); predicted here with "
                f"torchao's recipe on {len(converted)} Linear layers, speed not measured"
            )

    # ------------------------------------------------------------------ 3. beyond eager
    def try_compile(self, modes: Sequence[str]) -> None:
        """The best passing eager candidates again under torch.compile, one at a time, fastest
        first, each followed by its numerics check; stops when the budget cannot pay for the next
        (estimated from the compile time seen so far)."""
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
            and (r.policy == "fp32" or (self.verdicts.get(r.candidate.numerics) or _FAIL).passed)
        ]
        best = sorted(passing, key=speed, reverse=True)[:COMPILE_TOP]
        todo = [replace(r.candidate, compile=mode) for r in best for mode in modes]
        todo = [c for c in todo if not any(r.candidate == c for r in self.result.rows)]
        compile_s = MIN_COMPILE_S
        for n, candidate in enumerate(todo):
            # measuring it compiles once, checking it compiles again: pay for both
            if self.time_left() < 2 * compile_s + self.check_cost_s():
                skipped = ", ".join(c.label for c in todo[n:])
                self.notes.append(f"not compiled within the budget: {skipped} (--budget raises it)")
                return
            self.say(f"compiling {candidate.label}")
            measured = self._add(self._bench([candidate], self.deadline - RESERVE_S).measured)
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
            if candidate.numerics not in self.verdicts and self.time_left() > compile_s + self.check_cost_s():
                self.check(candidate.numerics)

    def try_optimizers(self, rec: Recommendation) -> None:
        """The pick with its optimizer's other implementations (for-loop / foreach / fused): same
        numerics, possibly faster steps. Only the ones the optimizer class offers."""
        assert self.result is not None
        if rec.candidate.optimizer or self.time_left() < 10:
            return
        # the optimizer's class, from the factory as written (it may need the module itself)
        probe = self.workload.make_optimizer(self.workload.model)
        import inspect

        accepted = inspect.signature(type(probe).__init__).parameters
        impls = [i for i, flag in (("foreach", "foreach"), ("fused", "fused")) if flag in accepted]
        todo = [replace(rec.candidate, optimizer=impl) for impl in impls]
        if todo:
            self.say(f"measuring the optimizer's implementations: {', '.join(c.label for c in todo)}")
            self._add(self._bench(todo, self.deadline - RESERVE_S).measured)

    def note_compute_share(self, rec: Recommendation) -> None:
        """Say where the next gain is when the pick spends most of its step outside matmuls."""
        assert self.result is not None
        row = next((r for r in self.result.rows if r.candidate == rec.candidate), None)
        share = row.compute_share if row is not None else None
        if share is not None and share < LOW_COMPUTE_SHARE:
            hint = "" if rec.candidate.compile else "; torch.compile fuses the elementwise rest"
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
        if 1.5 * cost > self.time_left():
            self.notes.append(f"{chosen.label} and {rival.label}: no budget left to re-measure them")
            return False
        self.say(f"re-measuring {chosen.label} and {rival.label}: within noise of each other")
        again = self._bench([chosen.candidate, rival.candidate], self.deadline - RESERVE_S, steps=steps)
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


_FAIL = CandidateCheck(Candidate("fp32"), Status.FAIL, "")


def tune(
    workload: Workload,
    *,
    budget_s: float = 300.0,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    steps: int = 4,
    warmup: int = 1,
    check_steps: int = 6,
    fix: bool = True,
    lint: bool = True,
    noise: float = 0.03,
    compile_modes: Sequence[str] = ("default",),
    optimizers: bool = True,
    train_steps: int = TRAIN_STEPS,
    progress: Progress | None = None,
    events: Events | None = None,
) -> TuneResult:
    """Find the fastest configuration that trains like fp32 on ``workload`` within ``budget_s`` seconds.

    Args:
        workload: the model, its batches, loss and optimizer.
        budget_s: seconds for the whole search (measuring, checking, compiling, re-measuring).
        device: 'cpu', 'cuda[:N]' (default: CUDA when available).
        batch_size: samples per step (default: the workload's).
        steps / warmup: paired rounds and (at least) untimed steps per candidate.
        check_steps: training steps compared with the strict-fp32 reference.
        fix: search a keep_fp32 rescue for a candidate that fails its check.
        lint: lint the model under the recommended policy.
        noise: the smallest relative speed difference treated as real.
        compile_modes: torch.compile modes tried on the best eager candidates (() for none).
        optimizers: try the pick with its optimizer's foreach / fused implementations.
        train_steps: the length of the training run compile time is amortised over: a compile
            that costs 90 s to save 5 ms per step is not recommended for a 100-step job.
        progress: receives one line per stage.
        events: receives each finished candidate as it comes: the sweeps' ``row`` events (see
            :func:`mixprec.bench`), ``output`` (what rebuilding the workload printed in a
            candidate's process) and the numerics checks' ``verdict`` events.

    The workload is validated first, by one strict-fp32 step in this process
    (:func:`mixprec.workload.validate_workload`).
    """
    from mixprec.exports import export_all

    if not isinstance(workload, Workload):
        raise UsageError(f"tune() takes a mixprec.Workload, got {type(workload).__name__}.")
    if isinstance(budget_s, bool) or not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise UsageError(f"budget must be a number of seconds > 0, got {budget_s!r}.")
    if isinstance(train_steps, bool) or not isinstance(train_steps, int) or train_steps < 1:
        raise UsageError(f"train_steps must be an integer >= 1, got {train_steps!r}.")
    modes = [replace(Candidate("fp32"), compile=m).compile for m in compile_modes]  # validated
    start = time.perf_counter()
    dev = resolve_device(device)
    info = detect(dev)
    say = progress or (lambda msg: None)
    say("checking the workload: one strict-fp32 step")
    validate_workload(workload, device=dev, batch_size=batch_size or workload.default_batch_size)
    search = _Search(
        workload,
        dev,
        dict(batch_size=batch_size, steps=steps, warmup=warmup, device=dev),
        check_steps=check_steps,
        fix=fix,
        noise=noise,
        train_steps=train_steps,
        deadline=start + budget_s,
        say=say,
        events=events or (lambda event: None),
    )
    search.measure_speed(info, start + SPEED_SHARE * budget_s)
    search.check_faster()
    search.finish_speed(info)
    search.check_faster()  # the candidates measured late, if any beat strict fp32
    search.try_compile([m for m in modes if m is not None])
    rec, ranked = search.decide()
    if rec is not None and optimizers:
        search.try_optimizers(rec)
        rec, ranked = search.decide()
    if rec is not None and (rec.tied_with or rec.noisy_with) and search.remeasure(rec):
        rec, ranked = search.decide()
    search.predict_fp8(info)  # a note for fp8 GPUs; it cannot change the pick here
    result = search.result
    assert result is not None
    if rec is not None:
        search.note_compute_share(rec)
    findings = None
    if lint and rec is not None and time.perf_counter() < search.deadline:
        findings = _lint(workload, rec, dev, search.notes)
        if findings:
            rec.lint_worth_fixing = [f for f in findings if f.get("severity") in ("warning", "error")][:5]
    exports = (
        export_all(rec.config(str(dev)), compile=rec.candidate.compile, optimizer=rec.candidate.optimizer)
        if rec
        else {}
    )
    elapsed = time.perf_counter() - start
    if elapsed > budget_s * 1.05:
        search.notes.append(
            f"tune took {elapsed:.0f} s of its {budget_s:.0f} s budget: a step under way when the budget "
            "ran out was finished, not thrown away"
        )
    exhausted = None
    if search.cut and (rec is None or rec.candidate.policy == "fp32"):
        pick = "nothing could be recommended" if rec is None else "only strict fp32 could be recommended"
        exhausted = f"the {budget_s:g} s budget ran out: {'; '.join(search.cut)}, so {pick}"
    return TuneResult(
        budget_exhausted=exhausted,
        workload=result.workload,
        description=workload.description,
        device=str(dev),
        recommendation=rec,
        ranked=ranked,
        bench=result,
        check=search.checked,
        lint=findings,
        budget_s=budget_s,
        elapsed_s=elapsed,
        env=result.env or environment.collect(dev),
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        notes=search.notes,
        exports={target: r.text for target, r in exports.items() if r.text is not None},
        export_refusals={target: r.refused for target, r in exports.items() if r.refused is not None},
    )


def _lint(
    workload: Workload, rec: Recommendation, device: torch.device, notes: list[str]
) -> list[dict] | None:
    from mixprec.linting import lint as run_lint

    try:
        findings = run_lint(workload, policy=rec.candidate.policy, device=device)
    except Exception as exc:  # lint is advice: its failure must not lose the recommendation
        notes.append(f"lint failed: {type(exc).__name__}: {exc}")
        return None
    return [f.to_dict() for f in findings]
