"""Say what was not tried (issue 40): a tune cut by its budget before any lower-precision candidate
ran says so in the banner, the console's last lines and the JSON (`not-measured` rows with the
reason and the budget that would try them), and exits with the budget code; a noisy passing row is
re-measured when the budget allows. On planted step times (tests/tuning/scripted.py)."""

from __future__ import annotations

import json
import random

import pytest

import mixprec
import mixprec.tuning
from mixprec.cli import main
from mixprec.errors import BudgetExhausted
from mixprec.report import view as report_view
from mixprec.report.html import render_report
from mixprec.status import Status

from .scripted import Planted, planted_clock, planted_framework  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("planted_clock", "planted_framework")


def _tune_cut(rows_before: int, how: str = "stop", compiled: bool = False):
    """A planted tune cut once its sweep has measured ``rows_before`` rows: by ``stop`` (as if the
    budget had ended) or by ``interrupt`` (a Ctrl-C); ``compiled``: with compiled candidates too."""
    rows: list[dict] = []

    def events(event):
        if event["event"] == "row":
            rows.append(event)

    seconds = {"fp32": 0.20, "bf16-mixed": 0.10, "bf16-true": 0.09}
    if compiled:
        seconds.update({f"{label}+compile": step * 0.8 for label, step in seconds.items()})
    return mixprec.tune(
        Planted(seconds, compile_s=2.0),
        budget_s=120 if compiled else 60,
        steps=4,
        warmup=1,
        check_steps=2,
        **({} if compiled else {"compile_modes": ()}),
        events=events,
        **{how: lambda: len(rows) >= rows_before},
    )


def _cut_after_strict_fp32():
    """A tune whose budget ends once the sweep has measured strict fp32 (the default `make demo`'s
    fate on a slow machine: fp32 measured, nothing in lower precision)."""
    return _tune_cut(1)


def test_a_tune_cut_before_any_lower_precision_candidate_ran_says_so_everywhere():
    result = _cut_after_strict_fp32()
    rec = result.recommendation
    assert rec is not None and rec.candidate.policy == "fp32"
    status = {r.label: (r.status, r.reason) for r in result.ranked}
    for label in ("bf16-mixed", "bf16-true"):
        assert status[label][0] == Status.NOT_MEASURED and status[label][1].startswith("not measured")
    assert rec.budget_to_try_s is not None and rec.budget_to_try_s > 60
    assert result.budget_exhausted and "not measured" in result.budget_exhausted
    assert f"--budget {rec.budget_to_try_s:g}" in result.budget_exhausted
    # the banner: not "no lower-precision candidate was both faster and numerically sound"
    tone, banner = report_view.verdict_line(result)
    assert tone == "warn" and "not by measurement" in banner and "budget ended" in banner
    assert "bf16-mixed" in banner and f"--budget {rec.budget_to_try_s:g}" in banner
    assert "was both faster and numerically sound" not in banner
    page = render_report(result, charts={})["html"][1].decode()
    assert "not by measurement" in page
    # the JSON: not-measured rows with their reasons
    data = json.loads(json.dumps(result.to_dict()))
    rows = {c["label"]: c for c in data["candidates"]}
    assert rows["bf16-mixed"]["status"] == "not-measured" and rows["bf16-mixed"]["throughput"] is None
    assert data["recommendation"]["budget_to_try_s"] == rec.budget_to_try_s
    again = mixprec.TuneResult.from_dict(data)
    assert {r.label: r.status for r in again.ranked}["bf16-true"] == Status.NOT_MEASURED


def test_the_console_ends_with_what_was_not_measured_and_exits_with_the_budget_code(
    tmp_path, capsys, monkeypatch
):
    result = _cut_after_strict_fp32()
    monkeypatch.setattr(mixprec.tuning, "tune", lambda *a, **k: result)
    out = tmp_path / "tune.json"
    code = main(["tune", "--model", "mlp", "--budget", "60", "--no-lint", "--json", str(out)])
    assert code == BudgetExhausted.exit_code == 5
    captured = capsys.readouterr()
    last = [line for line in captured.out.splitlines() if line.strip()][-3:]
    assert any("not measured, the budget ended first: bf16-mixed, bf16-true" in line for line in last), last
    error = captured.err.strip().splitlines()[-1]
    assert "budget exhausted" in error and "not measured" in error and "bf16-mixed" in error
    data = json.loads(out.read_text())
    assert {c["label"]: c["status"] for c in data["candidates"]}["bf16-mixed"] == "not-measured"


def test_an_interrupted_tune_says_it_was_interrupted_not_that_the_budget_ran_out(tmp_path):
    """A Ctrl-C 10 s into a 600 s tune, once strict fp32 was measured, printed "budget exhausted: the
    600 s budget ran out ... raise --budget", "about --budget 660 would try them", rows "stopped by
    the deadline", and "its check would take about 0 s, more than the 577 s left"; the result was a
    budget exit's. Interrupted, it says so, names no budget, and is never cached as the answer."""
    result = _tune_cut(1, "interrupt")
    rec = result.recommendation
    assert rec is not None and rec.candidate.policy == "fp32"
    assert result.budget_exhausted is None
    assert result.interrupted and result.interrupted.startswith("stopped after ")
    assert "of its 60 s budget: the speed sweep stopped by an interrupt" in result.interrupted
    status = {r.label: (r.status, r.reason) for r in result.ranked}
    assert status["bf16-mixed"][0] == Status.NOT_MEASURED and "by an interrupt" in status["bf16-mixed"][1]
    assert rec.budget_to_try_s is None and rec.untried and "tune was interrupted first" in rec.untried
    _, banner = report_view.verdict_line(result)
    assert "tune was interrupted before any lower-precision candidate" in banner
    said = " ".join([banner, *result.notes, rec.reason, *(r.reason for r in result.ranked)])
    wrongs = ("--budget", "budget ended", "by the deadline", "budget ran out", "about 0 s", "budget spent")
    for wrong in wrongs:
        assert wrong not in said, (wrong, said)
    again = mixprec.TuneResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again.interrupted == result.interrupted and again.budget_exhausted is None
    # the same cut made by the clock (``stop``: as if the time were up) is the budget's
    cut = _tune_cut(1, "stop")
    assert cut.interrupted is None and cut.budget_exhausted and "budget" in cut.budget_exhausted


@pytest.mark.parametrize(
    ("rows_before", "compiled"), [(2, False), (3, False), (4, False), (2, True), (5, True), (8, True)]
)
def test_an_interrupt_after_a_lower_precision_ran_blames_no_budget(rows_before, compiled):
    """(The review's cases, each said after a Ctrl-C: once bf16-mixed was measured, "numerics of
    bf16-mixed not checked: the budget could not pay ... (--budget raises it)"; while a candidate
    compiled, "stopped by the budget while compiling", "the budget ended while it compiled"; in the
    race, "the budget could not pay for more rounds".)"""
    result = _tune_cut(rows_before, "interrupt", compiled)
    assert result.interrupted and result.budget_exhausted is None
    said = " ".join([*result.notes, *(r.reason for r in result.ranked)])
    wrongs = ("budget ended", "by the deadline", "budget spent", "could not pay", "--budget", "by the budget")
    for wrong in wrongs:
        assert wrong not in said, (wrong, said)
    statuses = {r.label: r.status for r in result.ranked}
    if Status.NOT_MEASURED in {s for label, s in statuses.items() if label.endswith("+compile")}:
        # a compile the interrupt kept from being measured is a cut, as the budget's would be
        assert "compiled candidates were not measured" in result.interrupted


def test_a_tune_interrupted_before_strict_fp32_was_measured_says_so():
    """(Planted sessions always finish strict fp32: the result such a Ctrl-C leaves, made from one.)"""
    from dataclasses import replace

    from rich.console import Console

    from mixprec.report.tune import summary

    planted = Planted({"fp32": 0.20, "bf16-mixed": 0.10})
    result = mixprec.tune(
        planted, budget_s=60, steps=4, warmup=1, check_steps=2, compile_modes=(), interrupt=lambda: True
    )
    assert result.budget_exhausted is None and result.interrupted
    stopped = "stopped by an interrupt before strict fp32 was measured"
    bench = replace(result.bench, measured=[], stopped=stopped)
    result = replace(result, recommendation=None, ranked=[], bench=bench)
    console = Console(record=True, width=200)
    console.print(summary(result))
    text = console.export_text()
    assert "interrupted: stopped after" in text and "nothing was measured or checked" in text
    assert "budget exhausted" not in text and "--budget" not in text, text


def test_a_noisy_passing_row_is_re_measured_when_the_budget_allows():
    """bf16-true's steps jitter +-60%: too noisy to rank from its first 4 rounds; it is measured
    again with twice the rounds, and the row says so."""
    planted = Planted({"fp32": 0.20, "bf16-mixed": 0.10, "bf16-true": 0.06}, jitter=0.6, rng=random.Random(2))
    result = mixprec.tune(planted, budget_s=60, steps=4, warmup=1, check_steps=2, compile_modes=())
    assert result.recommendation is not None
    again = [n for n in result.notes if n.startswith("bf16-true re-measured with 8 paired rounds")]
    assert again and "was too noisy to rank" in again[0], result.notes
    row = next(r.row for r in result.ranked if r.label == "bf16-true")
    assert len(row.paired_ratios) >= 8 and any("re-measured" in n for n in row.notes)


def test_the_budget_reason_names_the_fp32_pick_it_settled_for():
    """An fp32 pick with something else (compiled) is not called plain strict fp32: the reason
    names it (it said "only strict fp32 could be recommended" over a recommended fp32+compile)."""
    from mixprec.policy import Candidate
    from mixprec.tuning.decide import Recommendation
    from mixprec.tuning.run import exhausted_reason

    def pick(candidate: Candidate) -> Recommendation:
        return Recommendation(candidate, 1.1, None, 0, None, "why")

    cuts = ["compiled candidates were not measured"]
    compiled = exhausted_reason(300, cuts, pick(Candidate("fp32", compile="default")))
    assert compiled is not None and "so only strict fp32 (fp32+compile) could be recommended" in compiled
    assert "so only strict fp32 could be recommended" in exhausted_reason(300, cuts, pick(Candidate("fp32")))
    assert exhausted_reason(300, cuts, None).endswith("so nothing could be recommended")
    assert exhausted_reason(300, cuts, pick(Candidate("bf16-mixed"))) is None
    assert exhausted_reason(300, [], pick(Candidate("fp32"))) is None
    # the budget cut fp32's own variants alone, every lower precision settled: not a budget exit
    assert exhausted_reason(300, cuts, pick(Candidate("fp32")), lower_left=False) is None


def test_a_budget_that_cut_only_fp32s_compiles_is_not_an_exhausted_budget():
    """The AVX2 EPYC's `make demo` (bf16 and fp16 emulated, every lower precision pruned at 6x
    strict fp32's step): the budget could not pay fp32+cl's compiles, and tune exited 5, "only
    strict fp32 (fp32+cl) could be recommended": `make demo` failed. No lower precision was left
    unmeasured or unchecked, so the cut could not have changed the pick's precision: exit 0, the
    untried compiles still said with the budget that would try them, and the pick said to be
    measured."""
    planted = Planted({"fp32": 0.20, "fp32+compile": 0.15, "bf16-mixed": 1.6, "bf16-mixed+compile": 1.5})
    result = mixprec.tune(planted, budget_s=30, steps=4, warmup=1, check_steps=2)
    rec = result.recommendation
    assert rec is not None and rec.candidate.label == "fp32", result.notes
    status = {r.label: r.status for r in result.ranked}
    assert status["bf16-mixed"] == Status.PRUNED and status["fp32+compile"] == Status.NOT_MEASURED
    assert any(n.startswith("not compiled: fp32+compile (the budget could not pay") for n in result.notes)
    assert result.budget_exhausted is None
    assert rec.untried is not None and "fp32+compile" in rec.untried
    # measured, not by default: bf16-mixed ran and lost (it said "the budget ended before any
    # lower-precision candidate was measured")
    _, banner = report_view.verdict_line(result)
    assert banner.startswith("Keep strict fp32: no lower-precision candidate that was measured"), banner
    assert "fp32+compile" in banner and "not by measurement" not in banner


def test_noisy_candidates_the_budget_cannot_re_measure_are_cut_as_a_lower_precision_where_one_is():
    """The first noisy candidate left un-re-measured stops the re-measures: it and every one after it
    are what the budget cut. An fp32 variant first (fp32+cl) made the cut fp32's alone, and a
    bf16-mixed after it no reason to exit 5."""
    import types

    from mixprec.budget import Budget
    from mixprec.policy import Candidate
    from mixprec.tuning.held import Held
    from mixprec.tuning.search import Search

    def cut_by(remeasure):
        budget = Budget(60.0)
        search = types.SimpleNamespace(
            decide=lambda: (types.SimpleNamespace(remeasure=remeasure), None),
            sweeps=types.SimpleNamespace(bench=types.SimpleNamespace(steps=4)),
            row=lambda cand: object(),
            budget=budget,
            costs=types.SimpleNamespace(remeasure_s=lambda cand: 1e9),  # (more than any budget)
            held=Held(budget),  # (nothing kept back to settle the pick)
            notes=[],
        )
        Search.remeasure_noisy(search)
        return budget

    both = cut_by((Candidate("fp32", channels_last=True), Candidate("bf16-mixed")))
    assert both.cuts == ["fp32+cl, bf16-mixed, too noisy to rank, not re-measured"]
    assert both.cut_a_lower_precision
    assert not cut_by((Candidate("fp32", channels_last=True),)).cut_a_lower_precision
