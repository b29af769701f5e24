"""A figure the next run repeats: a row's paired rounds pooled over more sessions until its
interval is narrow.

A sweep measures each candidate over a few paired rounds in one process of its own. On a quiet
machine that repeats; on the 2-core AMX Xeon VM the machine's pace moved between one process's
rounds and the next's more than their interval said: ResNet-50's bf16-mixed+cl read 1.61x over
the 4 rounds of one session (1.55-1.78) and 2.17x over the 11 of the next (1.41-3.76), and a plain
probe in one process 2.01x, 2.30x and 2.48x in three runs; more rounds in the same process narrow
an interval around that process's figure, not the spread between processes. Within one process
the same pair held still: over 12 minutes its 4-minute medians agreed within 2%, where fresh
processes of 8 rounds each spread 7.7% (4.1% of it their rounds' noise;
``benchmarks/speedup_drift.py``, ``benchmarks/results/cpu-intel-xeon-amx/``). Settling a row
measures its candidate again in fresh sweeps (each a strict-fp32 session and the candidate's,
paired as every sweep is) for the rounds its interval needs to reach ``width`` either side, at
least :data:`MIN_ROUNDS` in all and at most ``most``, at most :data:`SESSION_ROUNDS` in one
session (the rounds go to more processes, not to a longer one), and pools every round into the
row: its figure weighs each session by its rounds and by how far the sessions disagree
(:func:`~mixprec.measure.results.session_speedup`; issue 53). ``bench --settle`` does it for every row;
``tune`` for its pick (:mod:`mixprec.tuning.settle`, within its budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from mixprec.measure.results import BenchResult, BenchRow, session_speedup
from mixprec.policy import Candidate
from mixprec.status import Status

# A bootstrap interval of 4 rounds is about their range: a figure is settled over at least this many.
MIN_ROUNDS = 8
# More sessions a row is measured in at most (the rounds each needs are estimated from those so far).
SETTLE_SWEEPS = 5
# The most paired rounds one settling session measures: a fresh process's own pace is what the
# rounds beyond these would average (the AMX Xeon's bench settled 30 rounds in one session).
SESSION_ROUNDS = 8
# The sessions a settled figure is pooled over at least where its rounds allow: with two, one whose
# process ran 10-50% slow (a few fresh ones do) moves the figure halfway and nothing outvotes it;
# three that disagree give their median (:func:`~mixprec.measure.results.session_speedup`). Planted,
# with 12% of processes slow: 43% of 4+4-round figures more than 5% off, 24% of 4+4+4
# (benchmarks/session_outliers.py).
MIN_SESSIONS = 3

# One more paired sweep of these candidates for this many rounds each (its rows).
Sweep = Callable[[Sequence[Candidate], int], BenchResult]


def spread(row: BenchRow) -> float | None:
    """How far ``row``'s speedup interval reaches from its figure, as a share of it (the farther
    side): the interval it reports, which covers what its samples/s say too
    (:func:`mixprec.measure.results.assemble`). None without one."""
    if row.speedup_ci is None or not row.speedup_vs_fp32:
        return None
    low, high = row.speedup_ci
    return max(high - row.speedup_vs_fp32, row.speedup_vs_fp32 - low) / row.speedup_vs_fp32


def sessions_of(rounds: int, fewest: int = 1, least: int = 1) -> list[int]:
    """``rounds`` more paired rounds as settling measures them: the fewest sessions of at most
    :data:`SESSION_ROUNDS` rounds, split evenly (12 rounds are two sessions of 6: a session of 4
    would pay strict fp32's opening for four rounds), but at least ``fewest`` sessions where each
    then has ``least`` rounds or more (8 rounds are two sessions of 4 where two are wanted: see
    :data:`MIN_SESSIONS`)."""
    if rounds <= 0:
        return []
    count = max(math.ceil(rounds / SESSION_ROUNDS), min(fewest, rounds // max(least, 1)))
    each, more = divmod(rounds, count)
    return [each + 1] * more + [each] * (count - more)


def sessions_so_far(row: BenchRow) -> int:
    """The sessions ``row``'s figure pools: those its rounds came from (a row never settled has one:
    its sweep's) and the machine's earlier ones it pools (:mod:`mixprec.measure.record`)."""
    return (len(row.sessions) or 1) + len(row.earlier)


def rounds_so_far(row: BenchRow) -> int:
    """The paired rounds ``row``'s figure pools: its own and its earlier sessions'."""
    return len(row.paired_ratios) + sum(len(s) for s in row.earlier)


def next_sessions(row: BenchRow, rounds: int, least: int) -> list[int]:
    """``rounds`` more paired rounds of ``row`` as settling measures them (:func:`sessions_of`): at
    least as many sessions as make its figure's :data:`MIN_SESSIONS` with those it has, where each
    then has ``least`` rounds or more."""
    return sessions_of(rounds, fewest=MIN_SESSIONS - sessions_so_far(row), least=least)


def rounds_wanted(row: BenchRow, width: float, most: int) -> int:
    """More paired rounds ``row`` needs for its interval to reach ``width`` either side (a median's
    interval narrows as 1/sqrt(rounds)), at least :data:`MIN_ROUNDS` and at most ``most`` in all,
    and over two sessions at least; 0 where it is settled (or has ``most``), or is not a paired row
    that measured. One session's rounds share its processes' pace, so their interval cannot show
    the odd one: bench_vs_tune's run 18 on the EPYC settled bench's figure over one session of 10
    rounds at 1.85x [1.81-1.92], beside tune's 2.01x over two and plain PyTorch's 2.06x."""
    reach, done = spread(row), rounds_so_far(row)
    if row.status != Status.OK or reach is None:
        return 0
    needed = math.ceil(round(done * (reach / width) ** 2, 6))  # (16.000000000000014 is 16 rounds)
    wanted = min(most, max(MIN_ROUNDS, needed)) - done
    if sessions_so_far(row) < 2:  # (a second session of half the fewest: enough to see one 10% off)
        wanted = max(wanted, min(most - done, MIN_ROUNDS // 2))
    return max(0, wanted)


def pooled(first: BenchRow, so_far: BenchRow, new: BenchRow) -> BenchRow:
    """``new``'s row with every round of ``so_far`` before its own: the paired ratios and step times
    of all its sessions (and how many rounds each measured: what each weighs in its figure), the
    first session's cold step (a compiled candidate's compile) and notes."""
    return replace(
        new,
        paired_ratios=so_far.paired_ratios + new.paired_ratios,
        sessions=(*(so_far.sessions or (len(so_far.paired_ratios),)), len(new.paired_ratios)),
        step_times_ms=so_far.step_times_ms + new.step_times_ms,
        first_step_ms=first.first_step_ms,
        wall_s=(so_far.wall_s or 0.0) + (new.wall_s or 0.0),
        notes=first.notes,
        earlier=first.earlier,  # (the record as the first session found it: the later ones are its own)
    )


def settled_note(first: BenchRow, row: BenchRow, sessions: int) -> str:
    """The note on a settled row: its rounds in all, over how many sessions, and what its first
    session's said."""
    said = f"{first.speedup_vs_fp32 or 0:.2f}x"
    if first.speedup_ci:
        said += f" [{first.speedup_ci[0]:.2f}-{first.speedup_ci[1]:.2f}]"
    if first.earlier:  # (what its first session said alone, not pooled with the record)
        alone, interval = session_speedup(first.paired_ratios, first.sessions)
        said = f"{alone:.2f}x" + (f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else "")
    return (
        f"settled over {len(row.paired_ratios)} paired rounds in {sessions} session"
        f"{'s' if sessions > 1 else ''}{recorded(row)} (its interval now within {spread(row) or 0:.0%} "
        f"either side; its first {len(first.paired_ratios)} said {said})"
    )


def recorded(row: BenchRow) -> str:
    """What a settled note says of the earlier sessions ``row``'s figure pools ('' for none)."""
    if not row.earlier:
        return ""
    rounds = sum(len(s) for s in row.earlier)
    plural = "s" if len(row.earlier) > 1 else ""
    return f" and {len(row.earlier)} earlier session{plural} of it on this machine ({rounds} rounds)"


def settle_rows(result: BenchResult, sweep: Sweep, width: float, most: int) -> None:
    """Every measured row of ``result`` (strict fp32 aside) that is not settled, measured again by
    ``sweep`` (the candidates together, each for the most rounds any of them needs, at most
    :data:`SESSION_ROUNDS` a session) until it is, in at most :data:`SETTLE_SWEEPS` more sessions;
    each row pooled over its sessions, with a note."""
    firsts = {r.candidate: r for r in result.rows if not r.baseline_repeat and r.paired_ratios}
    sessions = dict.fromkeys(firsts, 1)
    for _ in range(SETTLE_SWEEPS):
        current = {r.candidate: r for r in result.rows if r.candidate in firsts and not r.baseline_repeat}
        wanted = {c: n for c, r in current.items() if (n := rounds_wanted(r, width, most))}
        if not wanted:
            break
        swept = sweep(list(wanted), sessions_of(max(wanted.values()))[0])
        measured = {
            r.candidate: r for r in result.measured if r.candidate in wanted and not r.baseline_repeat
        }
        for new in swept.measured:
            if new.candidate in wanted and new.status == Status.OK and not new.baseline_repeat:
                result.update(pooled(firsts[new.candidate], measured[new.candidate], new))
                sessions[new.candidate] += 1
    for row in result.rows:
        if (
            row.candidate in firsts
            and not row.baseline_repeat
            and (sessions[row.candidate] > 1 or row.earlier)
        ):
            note = settled_note(firsts[row.candidate], row, sessions[row.candidate])
            measured_row = next(r for r in result.measured if r.key == row.key)
            result.update(replace(measured_row, notes=(*measured_row.notes, note)))
