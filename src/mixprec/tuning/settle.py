"""Tune's pick, settled (:mod:`mixprec.measure.settle`) within the budget.

The speed sweep's few rounds (4 by default) rank candidates; the pick's figure is what the user
takes away, so once it is known its candidate is measured again in sessions of its own until its
interval is narrow, and the time for that is kept back from the speed sweep on (:func:`reserve`):
without it the stages before left 5 rounds of ResNet-50 on the AMX Xeon, where its pick needs
about 40 (60 s). The same pick read 2.44x in one tune and 1.92x in the next on a 2-core EPYC, and
2.23x [1.75-3.06] on the AMX Xeon beside bench's 1.70x and a plain probe's 2.01x (issue 53).
"""

from __future__ import annotations

from dataclasses import replace

from mixprec.measure import settle as settling
from mixprec.measure.results import BenchRow
from mixprec.policy import Candidate
from mixprec.status import Status
from mixprec.tuning.decide import Recommendation
from mixprec.tuning.search import SETTLE_SHARE, Search, fastest_row

# At most this many candidates' figures are settled in turn as the decision moves between them.
SETTLED_PICKS = 3


def reserve(search: Search) -> float:
    """Seconds the budget keeps back (its ``reserve_s``) to settle the pick's figure, taken once the
    speed sweep has measured: what settling its fastest row would cost
    (:meth:`~mixprec.tuning.cost.Costs.settling_s`: a third session where two may disagree, which a
    compile or the race can take first, :class:`~mixprec.tuning.held.Held`), at most
    ``SETTLE_SHARE`` of the budget; none where that row is settled already, or where that share
    cannot pay a session of the fewest rounds worth opening one for: kept, it would go unused
    (`make demo` beside two busy loops ended 50 s early with bf16-mixed+cl and the bf16-true rows
    never measured). :func:`settle` gives it back (or :meth:`Search.remeasure_noisy` first, for a
    noisy rival)."""
    fastest = fastest_row(search.result.rows)
    if fastest is None:
        return 0.0
    share = SETTLE_SHARE * search.budget.seconds
    search.held.keep(*search.costs.settling_s(fastest, share))

    def now() -> tuple[float, float]:  # (the pick as it stands: the decision's, else the fastest row)
        rec = search.decide()[0]
        row = search.row(rec.candidate) if rec is not None else fastest_row(search.result.rows)
        return search.costs.settling_s(row, share) if row is not None else (0.0, 0.0)

    search.held.price = now
    return search.held.seconds


def settle_pick(
    search: Search, rec: Recommendation | None, ranked: list
) -> tuple[Recommendation | None, list]:
    """The decision once the pick's figure is settled: where the settled figure moves it to another
    candidate (a pick chosen within the noise of a faster one, whose settled interval no longer
    reaches it), that one is settled in turn, the budget permitting, so the figure printed is the
    pick's own settled one or a note says it is not. Without it `make demo` and bench_vs_tune run 25
    on the AMX Xeon settled bf16-mixed (12 and 10 rounds), then recommended bf16-mixed+cl on its
    sweep's 4 rounds, and nothing said so."""
    settled: list[Candidate] = []
    while rec is not None and rec.candidate not in settled and len(settled) < SETTLED_PICKS:
        settled.append(rec.candidate)
        if not settle(search, rec):
            return rec, ranked
        rec, ranked = search.decide()
        if rec is not None and rec.candidate != settled[-1]:
            search.notes.append(
                f"{settled[-1].label}'s settled figure moved the decision to {rec.candidate.label}"
            )
    if rec is not None and rec.candidate not in settled:
        rounds = len(row.paired_ratios) if (row := search.row(rec.candidate)) else 0
        search.notes.append(
            f"{rec.candidate.label}'s figure not settled: the decision moved to it after "
            f"{len(settled)} settled figures; its figure is from {rounds} paired rounds"
        )
    return rec, ranked


def settle(search: Search, rec: Recommendation | None) -> bool:
    """The pick's row over the paired rounds it needs to be settled, those the budget pays (with
    what :func:`reserve` held back for it, where re-measuring a noisy rival did not take it), in at most
    :data:`~mixprec.measure.settle.SETTLE_SWEEPS` more sessions of at most
    :data:`~mixprec.measure.settle.SESSION_ROUNDS` rounds each. True where rounds joined it (the
    decision is to be made again)."""
    search.held.release()
    first = search.row(rec.candidate) if rec is not None else None
    if not search.sweeps.config.settle or first is None or first.status != Status.OK:
        return False
    row, measured, sessions = first, first, 1
    rounds, short = _more_rounds(search, row)
    while rounds and sessions <= settling.SETTLE_SWEEPS:
        search.sweeps.stage(f"settling {row.candidate.label}'s figure: {rounds} more paired rounds")
        result = search.sweeps.sweep([row.candidate], search.budget, rounds)
        new = next(
            (r for r in result.measured if r.candidate == row.candidate and r.status == Status.OK), None
        )
        if new is None:  # (the budget stopped it, or the candidate failed this time)
            why = f" ({result.stopped})" if result.stopped else ""
            search.notes.append(
                f"{row.candidate.label}'s figure not settled: its settling sweep measured no new row{why}; "
                "the figure is the first sweep's"
            )
            short = False
            break
        measured = settling.pooled(first, measured, new)
        search.result.update(measured)
        row, sessions = search.row(row.candidate) or row, sessions + 1
        rounds, short = _more_rounds(search, row)
    steps = search.sweeps.bench.steps
    unpaid = search.budget.why_ended(f"the budget pays no {steps} more paired rounds (--budget raises it)")
    if sessions == 1:
        if short:
            search.notes.append(
                f"{row.candidate.label}'s figure not settled (its interval reaches "
                f"{settling.spread(row) or 0:.0%} either side over {len(row.paired_ratios)} paired "
                f"rounds{settling.recorded(row)}): {unpaid}"
            )
        elif row.earlier:  # settled by what this machine measured of it before: nothing more to pay
            search.notes.append(f"{row.candidate.label} {settling.settled_note(first, row, sessions)}")
        return False
    note = settling.settled_note(first, row, sessions) + (f"; {unpaid}" if short else "")
    search.result.update(replace(measured, notes=(*first.notes, note)))
    search.notes.append(f"{row.candidate.label} {note}")
    return True


def _more_rounds(search: Search, row: BenchRow) -> tuple[int, bool]:
    """The paired rounds ``row`` needs that the budget pays (0: settled, or too few paid to open a
    session for), and whether the budget is why it gets fewer than it needs."""
    wanted = settling.rounds_wanted(row, search.sweeps.config.settle, search.sweeps.bench.settle_rounds)
    paid, steps = search.costs.rounds_paid(row, search.budget.left()), search.sweeps.bench.steps
    # (this session's share of them: the rest go to fresh sessions, whose pace is their own, as
    # many as make the figure's sessions three where the rounds allow)
    rounds = min(settling.next_sessions(row, wanted, least=steps)[0] if wanted else 0, paid)
    if rounds < steps:  # (fewer do not pay for strict fp32's opening)
        rounds = 0
    return rounds, paid < wanted
