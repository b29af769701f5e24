"""The cost model of a tune: what its next step would cost (measuring a candidate, checking its
numerics, compiling it, racing the finalists), from its rows so far, the compiles measured on this
machine (:class:`~mixprec.measure.compile_cache.CompileCosts`) and the pace its checks kept here."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from mixprec.budget import Budget
from mixprec.checking.check import Checker
from mixprec.events import Events
from mixprec.frameworks import Framework
from mixprec.hardware.device import detect
from mixprec.measure import settle as settling
from mixprec.measure.compile_cache import CompileCosts, cost_key
from mixprec.measure.config import BenchConfig
from mixprec.measure.race import FIRST_ROUNDS
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.policy import Candidate
from mixprec.status import Status
from mixprec.tuning.compiling import MIN_COMPILE_S
from mixprec.tuning.config import TuneConfig
from mixprec.tuning.speedups import speed

# What checking a compiled candidate's numerics adds to an eager check, in multiples of its first
# compile here: its checking process compiles its training step again (and recompiles as its
# optimizer state appears). After the speed run, where the backend's compiled artefacts outlive a
# process (Inductor's caches), most of that is read back: the nanoGPT's bf16-true+compile-step on
# the AMX Xeon compiled cold in 75 s in its speed run; its check compiled in 26 s from the cache
# (0.35x), in 97 s with the cache empty (1.3x). Priced 3x (the cold case, with a first-step probe
# compiled too, since gone), its check was priced 194 s and never ran in a 300 s tune (issue 53).
CHECK_COMPILES_CACHED = 0.5
CHECK_COMPILES = 1.5
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
# A measured session's wall time over its steps alone (its process, the model's set-up).
SESSION_COST = 1.3
# What a session compiles again, from Inductor's cache: about a third of a cold compile.
RECOMPILE_S = MIN_COMPILE_S / 3


class Setting(Protocol):
    """What the cost model and the numerics checks read of one tune
    (:class:`mixprec.tuning.search.Sweeps`): the settings every sweep measures with (``bench``), the
    strict fp32 each candidate is paired with (at its micro-batch under ``tune --batch auto``)."""

    workload: Any
    framework: Framework
    device: str
    config: TuneConfig
    bench: BenchConfig
    baseline: Candidate
    budget: Budget
    events: Events


class Costs:
    """The prices of one tune's next steps, from its rows (``result``, which every stage adds to)
    and the strict-fp32 checkers its numerics checks share (``checkers``, per micro-batch)."""

    def __init__(self, result: BenchResult, setting: Setting, checkers: Mapping[int | None, Checker]) -> None:
        self.result, self.setting, self.checkers = result, setting, checkers
        self.compile_costs = CompileCosts()
        self.compile_s: dict[str | None, float] = {}  # the longest compile seen, per scope
        self._paces: list[float] = []  # what each eager numerics check took here over its estimate
        # a predicted candidate's step over strict fp32's, timed on one layer before its check is priced
        self.slowdowns: dict[Candidate, float] = {}

    # ------------------------------------------------------------------ measuring
    def measure_s(self) -> float:
        """About what measuring one more eager candidate costs: the median wall time of the rows
        measured so far (set-up, warm-up and paired rounds), else :meth:`sweep_s`."""
        base = self.setting.baseline
        walls = sorted(
            r.wall_s
            for r in self.result.rows
            if r.wall_s and r.status == Status.OK and not r.baseline_repeat and r.candidate != base
        )
        return walls[len(walls) // 2] if walls else self.sweep_s()

    def sweep_s(self) -> float:
        """One candidate's warm-up and paired rounds beside strict fp32, at strict fp32's step."""
        bench = self.setting.bench
        return SESSION_COST * (bench.warmup + 2 * bench.steps + 2) * self._base_step_s()

    def opening_s(self, steps: int | None = None) -> float:
        """What a sweep after the first spends before its first candidate: it opens a strict-fp32
        session of its own (set-up, warm-up, the first timed steps), about what the first sweep's
        took (the baseline row's wall time), with its ``steps`` timed steps where that sweep times
        more than the first's. Unpriced, it was lost where a stage had time for its candidates
        alone: a re-measure started with that much left spent 23 s and replaced nothing, and a busy
        `make demo`'s late sweep spent its last 20 s opening strict fp32."""
        base = self.result.baseline  # (assembled anew on each read: read once)
        if base is None:
            opening = 0.0
        elif base.wall_s:
            opening = base.wall_s
        else:  # (a sweep under way: its strict-fp32 session is still open, its wall time unknown)
            opening = SESSION_COST * (self.setting.bench.warmup + self.setting.bench.steps) * _step_s(base)
        if (more := (steps or 0) - self.setting.bench.steps) > 0:
            opening += more * _step_s(base)
        return opening

    def remeasure_s(self, candidate: Candidate) -> float:
        """Measuring ``candidate`` again with twice the paired rounds (compiled: from the cache), in
        a sweep of its own."""
        steps = 2 * self.setting.bench.steps
        return self.opening_s(steps) + 2 * self.measure_s() + (RECOMPILE_S if candidate.compile else 0.0)

    def settle_s(self, row: BenchRow, rounds: int) -> float:
        """A sweep of ``row``'s candidate alone for ``rounds`` more paired rounds: strict fp32's
        opening, the candidate's set-up and warm-up as its sessions so far took them (their wall
        time beyond their paired rounds and its compile; compiled: its recompile from the cache),
        each round a step of strict fp32 and one of the candidate. (Pricing the warm-up steps alone
        left a 2-core VM's settling sweep stopped by the deadline before the candidate's rounds.)"""
        base_s, cand_s = self._steps_s(row)
        timed = len(row.paired_ratios) * (base_s + cand_s) + (row.compile_s or 0.0)
        set_up = max(SESSION_COST * (self.setting.bench.warmup + 2) * cand_s, (row.wall_s or 0.0) - timed)
        compiled = RECOMPILE_S if row.candidate.compile else 0.0
        return self.opening_s(rounds) + set_up + compiled + SESSION_COST * rounds * (base_s + cand_s)

    def settling_s(self, row: BenchRow, share: float) -> tuple[float, float]:
        """What settling ``row``'s figure costs (:mod:`mixprec.tuning.settle`), at most ``share``, and
        how much of that is a session to break a tie: its more paired rounds in the sessions settling
        measures them, and where those would leave its figure fewer than
        :data:`~mixprec.measure.settle.MIN_SESSIONS` sessions (the sweep's among them), one more of
        the sweep's rounds, measured only where the sessions so far disagree. (0, 0) where ``row``
        is settled already (a quiet machine's rows may be), or where ``share`` cannot pay a session
        of the fewest rounds worth opening one for. Without the third, bench_vs_tune's run 17 on
        the EPYC settled ResNet-50's pick over two sessions, 1.98-2.12x and then 1.40-1.64x,
        printed 1.78x between them, and had no time for the session that would have outvoted one."""
        width, steps = self.setting.config.settle, self.setting.bench.steps
        rounds = settling.rounds_wanted(row, width, self.setting.bench.settle_rounds) if width else 0
        if not rounds or share < self.settle_s(row, min(rounds, steps)):
            return 0.0, 0.0
        sessions = settling.next_sessions(row, rounds, least=steps)
        wanted = min(share, sum(self.settle_s(row, n) for n in sessions))
        if len(sessions) + settling.sessions_so_far(row) >= settling.MIN_SESSIONS:
            return wanted, 0.0
        tiebreak = min(share - wanted, self.settle_s(row, steps))
        return wanted + tiebreak, tiebreak

    def rounds_paid(self, row: BenchRow, seconds: float) -> int:
        """How many more paired rounds of ``row``'s candidate ``seconds`` pay (:meth:`settle_s`)."""
        base_s, cand_s = self._steps_s(row)
        left, per_round = seconds - self.settle_s(row, 0), SESSION_COST * (base_s + cand_s)
        rounds, steps = int(left / per_round), self.setting.bench.steps
        if rounds > steps:  # beyond the first sweep's, each round opens strict fp32 one step longer too
            rounds = int((left + steps * base_s) / (per_round + base_s))
        return max(0, rounds)

    def _base_step_s(self) -> float:
        """Strict fp32's step in seconds (1 s where it was not timed)."""
        return _step_s(self.result.baseline)

    def _steps_s(self, row: BenchRow) -> tuple[float, float]:
        """Strict fp32's step and ``row``'s, in seconds (strict fp32's where ``row`` was not timed)."""
        base_s = self._base_step_s()
        return base_s, row.step_time_ms.median_ms / 1e3 if row.step_time_ms else base_s

    def variants_s(self, candidate: Candidate, count: int) -> float:
        """Measuring ``count`` variants of ``candidate`` (its optimizer's implementations) in a sweep
        of their own, each warmed up and paired with strict fp32 (compiled: from the cache)."""
        return self.opening_s() + count * (self.sweep_s() + (RECOMPILE_S if candidate.compile else 0.0))

    def race_s(self, finalists: Sequence[BenchRow]) -> Callable[[int, int], float]:
        """What racing the leader (``finalists[0]``) against the first ``n`` others over ``rounds``
        paired rounds costs: :func:`mixprec.measure.race.race`'s ``cost_s``."""
        step_s = max((r.step_time_ms.median_ms / 1e3 for r in finalists if r.step_time_ms), default=1.0)

        def cost_s(n: int, rounds: int) -> float:
            # the leader and each rival warm up, then every round runs a side each; a compiled
            # session compiles again
            compiled = sum(1 for r in finalists[: n + 1] if r.candidate.compile)
            return SESSION_COST * (n + 1) * (RACE_WARMUP + 2 * rounds) * step_s + compiled * RECOMPILE_S

        return cost_s

    def race_to_win_s(self, row: BenchRow, best_pass: BenchRow | None) -> float:
        """What ``row``'s candidate needs after its check to be picked: nothing where it is faster
        than the fastest pass so far (``best_pass``), else the race's first rounds against it (only
        winning the race picks it). Beside two busy processes `make demo` spent its last 41 s
        checking bf16-true (1.76x; it failed) after bf16-mixed+cl (2.19x) had passed; the race of
        bf16-mixed+cl against bf16-mixed then had 4 s, and bf16-mixed was picked at 1.73x."""
        if best_pass is None or speed(row) > speed(best_pass):
            return 0.0
        return self.race_s([best_pass, row])(1, FIRST_ROUNDS)

    def keeping_a_check(
        self, budget: Budget, todo: Sequence[Candidate], known: Collection[Candidate]
    ) -> Budget:
        """The late sweep's budget: all that is left, less about one numerics check (with room to
        stop a candidate process) where the late candidates hold a lower precision whose numerics
        are not ``known`` yet. A sweep on a busy machine takes all the time it is given, and a faster
        candidate measured with none left to check it cannot be recommended: `make demo` beside
        two busy processes measured bf16-mixed at ~2x late and recommended fp32+cl, its numerics
        unpaid. (The time kept goes to the later stages when no check needs it.) Where what is
        left cannot pay for one more candidate and its check, nothing is kept: a speed measured
        without its verdict still tells the user what a larger --budget would check."""
        keep = self.check_room(todo, known)
        if not keep or not budget.can_pay(self.measure_s() + keep):
            return budget
        return budget.keeping(keep)

    def check_room(self, candidates: Sequence[Candidate], known: Collection[Candidate]) -> float:
        """About one numerics check, with room to stop a candidate process, where ``candidates``
        hold a lower precision whose numerics are not ``known`` yet (0 where none does)."""
        unknown = [c for c in candidates if c.policy != "fp32" and c.numerics not in known]
        return CHECK_ROOM * max((self.check_s(c.numerics, c.micro_batch) for c in unknown), default=0.0)

    # ------------------------------------------------------------------ checking
    def check_s(self, candidate: Candidate | None = None, micro_batch: int | None = None) -> float:
        """About what checking ``candidate``'s numerics at ``micro_batch`` costs (``tune --batch
        auto``; None: the run's batch). ``candidate`` None: a lower precision not measured yet,
        priced at strict fp32's step. The candidate's training run and first-step probe at its
        measured step, its per-layer ranges, and the strict-fp32 runs it still needs (the reference
        and chaos runs and the reference's ranges for the first check at a micro-batch, one run a
        rounding of its half format apart once per format), times what checks took here against
        that estimate so far (:attr:`pace`). Priced 2x per fp32 step and 4 runs for every first
        check, the default tune's first check of bf16-mixed was estimated at 220 s beside two busy
        processes on the 2-core EPYC and never started (priced from its runs, it took 113 s)."""
        return self.pace * self.unpaced_check_s(candidate, micro_batch)

    def prediction_check_s(self, candidate: Candidate) -> float:
        """:meth:`check_s` of a candidate whose numerics are only predicted here: its steps at strict
        fp32's times what its emulation costs over fp32 on this device (:meth:`slowdown`), at the
        micro-batch the predictions are checked at."""
        self.slowdown(candidate)  # timed here once, before its first price
        return self.check_s(candidate, self.setting.baseline.micro_batch)

    def slowdown(self, candidate: Candidate) -> float:
        """The emulation of ``candidate`` over strict fp32 here, timed once by the backend
        (:meth:`~mixprec.frameworks.Framework.emulation_slowdown`)."""
        if candidate not in self.slowdowns:
            framework = self.setting.framework
            self.slowdowns[candidate] = framework.emulation_slowdown(candidate, self.setting.device)
        return self.slowdowns[candidate]

    def unpaced_check_s(self, candidate: Candidate | None, micro_batch: int | None) -> float:
        """:meth:`check_s` before the pace: what a check's wall time is compared with."""
        key = micro_batch or self.setting.baseline.micro_batch
        fp32_s = self.step_s(self.setting.framework.baseline, key)
        slow = self.slowdowns.get(candidate, 1.0) if candidate is not None else 1.0
        cand_s = (self.step_s(candidate, key) if candidate is not None else fp32_s) * slow
        checker = self.checkers.get(key)
        # the steps the checks compare (more than asked where a reference needed them to learn: a
        # new micro-batch's will too), and each run's first-step probe
        asked = max((c.steps for c in self.checkers.values()), default=self.setting.config.check.steps)
        steps = (checker.steps if checker is not None else asked) + 1
        fp32_runs = 0 if checker is not None else 2
        if candidate is None or checker is None or checker.floor_run_needed(candidate):
            fp32_runs += 1
        ranges = 1 if checker is not None else 2
        # (the last range collection is the candidate's own: at its emulation's pace)
        ranged_s = RANGES_STEPS * (ranges - 1 + slow) * fp32_s
        return CHECK_STEP_COST * steps * (fp32_runs * fp32_s + cand_s) + ranged_s

    def row_check_s(self, row: BenchRow) -> float:
        """Checking the numerics of ``row``'s candidate at its micro-batch, with what compiling it
        again adds (:meth:`check_compile_s`; from the cold prior where no compile was measured)."""
        cand = row.candidate
        compiles = row.compile_s if row.compile_s is not None else MIN_COMPILE_S
        return self.check_s(cand.numerics, cand.micro_batch) + (
            self.check_compile_s(cand, compiles) if cand.compile else 0.0
        )

    def check_compile_s(self, candidate: Candidate, compile_s: float) -> float:
        """What a numerics check of ``candidate`` spends compiling, its compile here priced or
        measured at ``compile_s`` (a compile from the cache is cheap: the base is its first, cold
        compile here where one was recorded): :data:`CHECK_COMPILES_CACHED` times that where the
        backend's compiled artefacts outlive the speed run's process, :data:`CHECK_COMPILES`
        where the check compiles cold."""
        cold = self.compile_costs.cold_s(self._cost_key(candidate)) or 0.0
        share = CHECK_COMPILES_CACHED if self.setting.framework.compiles_cached else CHECK_COMPILES
        return share * max(compile_s, cold)

    def step_s(self, candidate: Candidate, micro_batch: int | None) -> float:
        """Seconds of one measured training step of ``candidate`` (a numerics key) at ``micro_batch``
        samples (None: the run's batch), from the rows measured so far: the time per sample of its
        own rows (those at that micro-batch first), else of the slowest row of its numerics, else
        of strict fp32's, times the samples of a checked step."""
        size = micro_batch or self.setting.bench.batch_size or self.result.batch_size
        rows = [r for r in self.result.rows if r.status == Status.OK and r.throughput]
        own = [r for r in rows if r.candidate.unbatched == candidate.unbatched]
        found = (
            [r for r in own if r.batch_size == size]
            or own
            or [r for r in rows if r.candidate.numerics == candidate.numerics]
            or [r for r in rows if r.candidate.unbatched == self.setting.framework.baseline.unbatched]
        )
        if not found:
            return 1.0
        return size / min(t for r in found if (t := r.throughput))

    @property
    def pace(self) -> float:
        """What checks took here over their estimates: the mean of the eager ones so far (1.0
        before any)."""
        return sum(self._paces) / len(self._paces) if self._paces else 1.0

    def paced(self, seconds: float, estimate: float) -> None:
        """A whole eager check took ``seconds`` where :meth:`unpaced_check_s` said ``estimate``: the
        next estimate follows this machine's pace (a busy one, hooks that cost more here), the mean
        of the checks so far (the first pays one-time costs)."""
        self._paces.append(min(max(seconds / estimate, 0.5), 4.0))

    # ------------------------------------------------------------------ compiling
    def compiled(self, row: BenchRow) -> None:
        """Remember what compiling ``row``'s candidate took here (for this run and the next)."""
        if row.compile_s is None:
            return
        self.compile_costs.record(self._cost_key(row.candidate), row.compile_s)
        scope = row.candidate.compile_scope
        self.compile_s[scope] = max(self.compile_s.get(scope, 0.0), row.compile_s)

    def cut_off(self, candidate: Candidate, seconds: float) -> None:
        """The budget stopped ``candidate``'s measurement ``seconds`` into its compile: the next
        tune prices that compile at least that (:meth:`CompileCosts.record_cut`)."""
        self.compile_costs.record_cut(self._cost_key(candidate), seconds)

    def compile_price(
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

    def compile_and_check_s(self, candidate: Candidate, compile_s: float, known: bool) -> float:
        """What must fit before ``candidate`` is compiled, its compile priced ``compile_s``: measuring
        it compiles once (and half again: a recompile), checking it compiles again
        (:meth:`check_compile_s`). A first compile is only the prior's guess (``known`` False): what
        measuring it costs is gated here, and its check once the measured compile prices it
        (:meth:`row_check_s`). Gated on 4.5x the prior, the default tune of the nanoGPT-style GPT on
        the EPYC, its eager stages slowed by other work beside it, compiled nothing (73 s left for
        compiling, 112 s priced), where its step compiles in 5-12 s and runs 1.2x faster than the
        eager pick."""
        checking = self.check_compile_s(candidate, compile_s) if known else 0.0
        return 1.5 * compile_s + checking + self.check_s(candidate.numerics, candidate.micro_batch)

    def measure_compiled_s(self, compile_s: float) -> float:
        """Measuring a compiled candidate whose compile is priced ``compile_s``."""
        return 1.5 * compile_s + self.measure_s()

    def _cost_key(self, candidate: Candidate) -> str:
        bench, framework = self.setting.bench, self.setting.framework
        threads = bench.threads if isinstance(bench.threads, int) else framework.threads()
        machine, batch = detect(self.setting.device).name, bench.batch_size or 0
        return cost_key(framework.name, self.result.workload, batch, candidate.label, machine, threads)


def _step_s(base: BenchRow | None) -> float:
    """The strict-fp32 row ``base``'s step in seconds (1 s where it was not timed)."""
    return base.step_time_ms.median_ms / 1e3 if base is not None and base.step_time_ms else 1.0
