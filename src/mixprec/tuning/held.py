"""The time tune keeps back from its stages to settle the pick's figure (:mod:`mixprec.tuning.settle`),
and the part of it that would pay a session to break a tie, which work that may change the pick
takes first (:meth:`~mixprec.tuning.cost.Costs.settling_s`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mixprec.budget import Budget


@dataclass
class Held:
    """Seconds kept back in ``budget``'s reserve (``seconds``), of which ``tiebreak_s`` would pay a
    third settling session, measured only where the two before it disagree. ``price``: what
    settling the pick as it stands now would cost (seconds, tie-break's part), asked before work
    that wants the time (:meth:`reprice`)."""

    budget: Budget
    seconds: float = 0.0
    tiebreak_s: float = 0.0
    price: Callable[[], tuple[float, float]] | None = None

    def keep(self, seconds: float, tiebreak_s: float) -> None:
        """Keep ``seconds`` back (``tiebreak_s`` of them to break a tie)."""
        self.budget.reserve_s += seconds
        self.seconds, self.tiebreak_s = seconds, tiebreak_s

    def release(self) -> None:
        """Give all of it back to the budget (to settle the pick, or for a noisy rival first)."""
        self.budget.reserve_s -= self.seconds
        self.seconds = self.tiebreak_s = 0.0

    def reprice(self) -> float:
        """Give back what settling the pick as it stands no longer needs, and say how many seconds:
        the time was kept for the fastest row after the speed sweep, and the pick may be another
        row now, or be settled by this machine's record of it (:mod:`mixprec.measure.record`).
        Kept, bench_vs_tune's run 32 on the EPYC held the time for bf16-true+cl, which then failed
        its check, while the pick, bf16-mixed+cl, needed none: its compile and its optimizer's
        implementations were "budget spent" and tune ended at 193 s of 300. Never more than was
        kept: settling takes what is left at its turn."""
        if self.price is None or not self.seconds:
            return 0.0
        seconds, tiebreak_s = self.price()
        freed = max(0.0, self.seconds - seconds)
        if freed:
            self.budget.reserve_s -= freed
            self.seconds, self.tiebreak_s = seconds, min(self.tiebreak_s, tiebreak_s, seconds)
        return freed

    def tiebreak_for(self, cost_s: float, budget: Budget) -> bool:
        """Whether time was given back so that ``budget`` (this one, or a share of it taken before:
        take it again) pays work costing ``cost_s`` that may change the pick (a compile, the race, a
        check, the optimizer's other implementations): what settling the pick no longer needs
        (:meth:`reprice`), then the tie-break's part; which candidate is picked comes before how
        closely its figure is known. Kept, it left bench_vs_tune's run 20 on the EPYC no race of
        bf16-mixed against bf16-mixed+cl (9.6% faster, within the noise of their sweep), and
        bf16-mixed was picked, its optimizer's implementations unmeasured; and a cached compile of
        bf16-mixed untried on a planted 30 s tune (tests/tuning/test_compile_pricing.py)."""
        return self._give(tiebreak=True, cost_s=cost_s, budget=budget)

    def all_for(self, cost_s: float, budget: Budget) -> bool:
        """Whether all of it was given back so that ``budget`` pays a check costing ``cost_s`` where
        no candidate has passed yet: without one there is no pick whose figure to settle. Kept,
        `make demo` beside two busy loops left bf16-mixed (1.89x) unchecked for want of 107 s with
        75 s kept back, and ended at 193 s of its 300 with strict fp32 (exit 5)."""
        return self._give(tiebreak=False, cost_s=cost_s, budget=budget)

    def _give(self, *, tiebreak: bool, cost_s: float, budget: Budget) -> bool:
        if budget.can_pay(cost_s):
            return False
        freed = self.reprice()
        if budget.can_pay(cost_s - freed):
            return True  # (what the pick no longer needs pays it)
        part = self.tiebreak_s if tiebreak else self.seconds
        if not part or not budget.can_pay(cost_s - freed - part):
            return False
        self.budget.reserve_s -= part
        self.seconds -= part
        self.tiebreak_s = 0.0  # (either part takes the tie-break's first)
        return True
