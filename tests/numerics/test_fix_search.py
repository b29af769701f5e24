"""The fix searches run each differential run once: where the check is short enough to search at
its full length, verifying the found set is the trial that found it (over a script each run is a
launch of the user's training: the fp8 check of tests/frameworks/test_script_lowformats.py made 11)."""

from __future__ import annotations

from mixprec.budget import Budget
from mixprec.numerics.fix import MapSpace, Trials, search_keep_fp32, search_precision_map
from mixprec.numerics.results import CandidateCheck
from mixprec.policy import Candidate


class Comparison:
    max_rel_loss_diff = output_sqnr_db = total_grad_sqnr_db = min_grad_sqnr_db = 0.0
    skipped_steps = 0


def _trials(steps: int, search_steps: int) -> Trials:
    return Trials(steps, search_steps, Budget(600.0), stage=lambda _: None)


def test_a_verification_that_repeats_a_trial_is_that_trial():
    runs: list[tuple[tuple[str, ...], int]] = []

    def run(entries, steps):  # passes once "head" is kept in bf16
        runs.append((tuple(entries), steps))
        return "head" in entries, "ok", Comparison()

    cand, space = Candidate("fp8-rowwise"), MapSpace(["mix", "head"], suspects=["mix", "head"])
    result = CandidateCheck(cand.label, "fail", "planted")
    search_precision_map(run, cand, result, space, _trials(3, 3))
    assert result.fix_keep_bf16 == ["head"] and result.fix_verified
    assert len(runs) == len(set(runs)) == 3  # [mix], [mix, head], [head]: the verify of [head] ran once
    runs.clear()
    result = CandidateCheck(cand.label, "fail", "planted")
    search_precision_map(run, cand, result, space, _trials(8, 3))
    assert runs[-1] == (("head",), 8)  # a longer verification is a run of its own


def test_the_keep_fp32_search_verifies_without_running_its_last_trial_again():
    runs: list[tuple[tuple[str, ...], int | None]] = []

    def run(cand, keep, steps):
        runs.append((tuple(keep), steps))
        return "norm" in keep, "ok", Comparison()

    cand = Candidate("fp16-true")
    result = CandidateCheck(cand.label, "fail", "planted")
    search_keep_fp32(run, cand, result, ["attn", "norm"], 4, _trials(3, 3))
    assert result.fix_keep_fp32 == ["norm"] and result.fix_verified
    assert runs == [(("attn",), 3), (("attn", "norm"), 3), (("norm",), 3)]
