"""The numerics side of a tune: its checks, one strict-fp32 checker per micro-batch (its reference
runs made once, shared by every candidate checked there), the verdicts so far and why what was not
checked was not; and the numerics predicted for what this device cannot run fast."""

from __future__ import annotations

from dataclasses import replace

from mixprec import clock
from mixprec.budget import INTERRUPTED, what_ended
from mixprec.checking.check import Checker, check, make_checker
from mixprec.hardware.device import DeviceInfo
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.policy import Candidate
from mixprec.status import Status
from mixprec.tuning.cost import Costs, Setting
from mixprec.tuning.decide import Untried

# An emulation this many times slower than strict fp32 is named when it keeps a prediction from
# running (a slower one than the format's hardware would be is expected; one this far off is news).
SAID_SLOWDOWN = 4.0
# Why a prediction did not run, where no price is to blame.
SPENT = "budget spent"


class Checks:
    """The numerics checks of one tune and their verdicts. Each is priced and timed by ``costs``,
    which reads ``checkers`` (one per micro-batch, made here) for the runs a next check still needs."""

    def __init__(self, setting: Setting, costs: Costs, checkers: dict[int | None, Checker]) -> None:
        self.setting, self.costs, self.checkers = setting, costs, checkers
        self.verdicts: dict[Candidate, CandidateCheck] = {}  # per numerics key
        self.checked: CheckResult | None = None  # every check's, in the order they ran
        self.not_checked: dict[Candidate, str] = {}  # numerics key -> why its check did not run

    def check(
        self, candidate: Candidate, fix: bool | None = None, micro_batch: int | None = None
    ) -> CandidateCheck:
        """The numerics of ``candidate`` (a numerics key), at ``micro_batch`` where the measured
        candidate runs one (``tune --batch auto``: checked at the micro-batch it would train at)."""
        setting = self.setting
        if micro_batch not in self.checkers:
            at_size = replace(
                setting.config.check,
                batch_size=micro_batch or setting.bench.batch_size,
                device=setting.device,
            )
            self.checkers[micro_batch] = make_checker(
                setting.workload, at_size, events=setting.events, budget=setting.budget
            )
        at = f" at micro-batch {micro_batch}" if micro_batch else ""
        setting.events({"event": "stage", "text": f"checking numerics of {candidate.label}{at}"})
        estimate = self.costs.unpaced_check_s(candidate, micro_batch)
        started = clock.now()
        res = check(
            setting.workload,
            policies=(candidate,),
            fix=setting.config.check.fix if fix is None else fix,
            checker=self.checkers[micro_batch],
            events=setting.events,
        )
        if self.checked is None:
            self.checked = res
        else:
            self.checked.candidates.extend(res.candidates)
        verdict = res.candidates[0]
        self.verdicts[candidate] = verdict
        self.not_checked.pop(candidate, None)
        searched = verdict.fix_keep_fp32 or verdict.fix_keep_bf16 or verdict.fix_note
        whole = verdict.verdict != Status.ERROR and len(verdict.losses) >= self.checkers[micro_batch].steps
        if estimate and whole and not candidate.compile and not searched:
            # a compile, a rescue search or a run that ended early in the time says nothing about
            # the next check's pace
            self.costs.paced(clock.now() - started, estimate)
        return verdict

    def left_unchecked(self, cost_s: float, race_s: float, left: dict[Candidate, float]) -> str:
        """Why the next check (about ``cost_s``, ``race_s`` of it the race a pass would need) and
        those ``left`` after it (numerics key -> its check's price) do not run: each left gets its
        row's reason, and the next one's note is returned."""
        interrupted = self.setting.budget.interrupted()
        ended = what_ended(interrupted)
        for numerics, price in left.items():
            self.not_checked[numerics] = (
                f"numerics not checked: {ended} first (about {price:.0f} s more would check it)"
            )
        would = "its check and the race it would need" if race_s else "its check"
        return (
            INTERRUPTED
            if interrupted
            else f"the budget could not pay the about {cost_s:.0f} s {would} would take (--budget raises it)"
        )

    def predict(self, info: DeviceInfo) -> tuple[dict[Candidate, Untried], list[str]]:
        """Candidates the device cannot run fast but whose numerics can be computed here (fp8 on a
        CPU through torchao's recipe): whether they would pass, a labelled prediction, never a
        measured speed; each a row of the decision table, and the notes saying so."""

        def affordable(cand: Candidate) -> bool:
            return self.setting.budget.can_pay(self.costs.prediction_check_s(cand))

        setting = self.setting
        predicted, said = setting.framework.predictions(
            setting.workload, info, affordable, policies=setting.config.policy_names
        )
        notes = list(said)  # the backend's own list is not this tune's to add to
        rows: dict[Candidate, Untried] = {}
        for i, cand in enumerate(predicted):
            if not affordable(cand):
                why = self._unpaid(cand)
                stopped = why == INTERRUPTED
                raise_it = "" if stopped else " (--budget raises it)"
                notes.append(f"{cand.label} numerics not predicted: {why}{raise_it}")
                for left in predicted[i:]:
                    first = why if stopped or (left == cand and why != SPENT) else "the budget ended first"
                    rows[left] = Untried(
                        left,
                        Status.PREDICTED,
                        f"not predicted: {first}; its speed cannot be measured on this "
                        f"device (no {left.spec.compute_format} tensor cores)",
                    )
                return rows, notes
            verdict = self.check(cand, micro_batch=self.setting.baseline.micro_batch)
            outcome = (
                "would pass"
                if verdict.passed
                else "is inconclusive on"
                if verdict.verdict == Status.INCONCLUSIVE
                else "would fail"
            )
            rows[cand] = Untried(
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
            notes.append(
                f"{cand.label} {outcome} the numerics check on an {cand.spec.compute_format} GPU "
                f"({verdict.reason}){mapped}; {verdict.predicted or 'predicted here, speed not measured'}"
            )
        return rows, notes

    def _unpaid(self, candidate: Candidate) -> str:
        """Why the budget cannot pay ``candidate``'s prediction: an interrupt, spent, or its
        emulation's price where that is more than what is left (a Ctrl-C once read "its check would
        take about 0 s, more than the 577 s left")."""
        budget = self.setting.budget
        if budget.interrupted():
            return INTERRUPTED
        slow, price = self.costs.slowdowns.get(candidate, 1.0), self.costs.prediction_check_s(candidate)
        if slow < SAID_SLOWDOWN or price <= budget.left():
            return SPENT
        left = max(budget.left(), 0.0)
        return (
            f"its emulation here runs {slow:,.0f}x strict fp32's time (one Linear layer timed both ways), "
            f"so its check would take about {price:,.0f} s, more than the {left:,.0f} s left"
        )
