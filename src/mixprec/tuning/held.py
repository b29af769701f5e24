"""The time tune keeps back from its stages to settle the pick's figure (:mod:`mixprec.tuning.settle`),
and the part of it that would pay a session to break a tie, which work that may change the pick
takes first (:meth:`~mixprec.tuning.cost.Costs.settling_s`)."""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.budget import Budget


@dataclass
class Held:
    """Seconds kept back in ``budget``'s reserve (``seconds``), of which ``tiebreak_s`` would pay a
    third settling session, measured only where the two before it disagree."""

    budget: Budget
    seconds: float = 0.0
    tiebreak_s: float = 0.0

    def keep(self, seconds: float, tiebreak_s: float) -> None:
        """Keep ``seconds`` back (``tiebreak_s`` of them to break a tie)."""
        self.budget.reserve_s += seconds
        self.seconds, self.tiebreak_s = seconds, tiebreak_s

    def release(self) -> None:
        """Give all of it back to the budget (to settle the pick, or for a noisy rival first)."""
        self.budget.reserve_s -= self.seconds
        self.seconds = self.tiebreak_s = 0.0

    def tiebreak_for(self, cost_s: float, budget: Budget) -> bool:
        """Whether the tie-break's part was given back so that ``budget`` (this one, or a share of it
        taken before: take it again) pays work costing ``cost_s`` that may change the pick (a
        compile, the race, a check, the optimizer's other implementations): which candidate is
        picked comes before how closely its figure is known. Kept, it left bench_vs_tune's run 20 on
        the EPYC no race of bf16-mixed against bf16-mixed+cl (9.6% faster, within the noise of their
        sweep), and bf16-mixed was picked, its optimizer's implementations unmeasured; and a cached
        compile of bf16-mixed untried on a planted 30 s tune (tests/tuning/test_compile_pricing.py)."""
        return self._give(self.tiebreak_s, cost_s, budget)

    def all_for(self, cost_s: float, budget: Budget) -> bool:
        """Whether all of it was given back so that ``budget`` pays a check costing ``cost_s`` where
        no candidate has passed yet: without one there is no pick whose figure to settle. Kept,
        `make demo` beside two busy loops left bf16-mixed (1.89x) unchecked for want of 107 s with
        75 s kept back, and ended at 193 s of its 300 with strict fp32 (exit 5)."""
        return self._give(self.seconds, cost_s, budget)

    def _give(self, part: float, cost_s: float, budget: Budget) -> bool:
        if not part or budget.can_pay(cost_s) or not budget.can_pay(cost_s - part):
            return False
        self.budget.reserve_s -= part
        self.seconds -= part
        self.tiebreak_s = 0.0  # (either part takes the tie-break's first)
        return True
