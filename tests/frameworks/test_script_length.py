"""Scripts end at their own last step (their --steps, max_iters, epochs), and the strict-fp32 baseline
steps through the whole sweep: a measured session whose script ends starts it again, warmed up
untimed; one too short to warm up again is one line saying so (the H200's `mixprec tune -- python
plain_loop.py` ended with a BrokenPipeError traceback and nothing written when the 200-step script
ended under its baseline)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mixprec.cli import main

SCRIPT = Path(__file__).parent / "scripts" / "plain_loop.py"
SMALL = ["--d-model", "32", "--layers", "1"]


def test_a_script_that_ends_is_started_again_and_warmed_up_untimed():
    """The session the paired sweep steps (the baseline's steps through the whole sweep): a 6-step
    script gives 5 steps a run (a step is reported when the next begins), so 8 timed steps after a
    2-step warm-up need two more runs, each warmed up again and untimed."""
    from mixprec.frameworks.script import ScriptWorkload
    from mixprec.frameworks.script.session import ScriptSession
    from mixprec.frameworks.session import BenchSettings
    from mixprec.policy import Candidate

    workload = ScriptWorkload.from_command([sys.executable, str(SCRIPT), "--steps", "6", *SMALL])
    settings = BenchSettings(device="cpu", batch_size=16, warmup=2, adaptive_warmup=False)
    try:
        session = ScriptSession(workload, Candidate("fp32", framework="script"), settings)
        assert session.warm_up(lambda event: True)
        events = [session.step(timed=True) for _ in range(8)]
        measurement = session.finish()
        failed = workload.scratch / "failed"
        left = sorted(p.name for p in failed.iterdir()) if failed.exists() else []
    finally:
        workload.close()
    # runs of 5: 2 warm-up + 3 timed, then 2 + 3 again, then 2 + 2: the restarts' warm-ups untimed
    assert session.restarts == 2 and session.script_steps == 5
    assert [e["index"] for e in events] == list(range(2, 10))  # the numbering goes on across runs
    assert len(measurement.step_times_s) == 8 and len(measurement.warmup_times_s) == 2
    said = "the script ended on its own: each run measured its first 5 steps, started again 2 time(s)"
    assert measurement.notes == [f"{said}, each warmed up untimed"]
    assert left == []  # an end of the script's own is no failure: no log kept as one


def test_a_script_too_short_to_warm_up_again_is_one_line(tmp_path, capsys):
    command = [sys.executable, str(SCRIPT), "--steps", "3", *SMALL]
    code = main(["bench", "--policies", "fp32", "--steps", "3", "--", *command])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert "the script ended on its own: after 2 steps, too few to time it again" in err
    assert "give it more steps (its --steps, max_iters or epochs)" in err


def test_a_k_fold_script_measured_says_its_runs_end_at_its_second_model():
    """A measured k-fold script ends each run at its second model (its first model's steps are what
    is timed); the note said "the script ended on its own", as of a script at its last step."""
    from mixprec.frameworks.script import ScriptWorkload
    from mixprec.frameworks.script.session import ScriptSession
    from mixprec.frameworks.session import BenchSettings
    from mixprec.policy import Candidate

    kfold = Path(__file__).parent / "scripts" / "kfold.py"
    workload = ScriptWorkload.from_command([sys.executable, str(kfold), "--steps", "4"])
    settings = BenchSettings(device="cpu", batch_size=16, warmup=2, adaptive_warmup=False)
    try:
        session = ScriptSession(workload, Candidate("bf16-mixed", framework="script"), settings)
        assert session.warm_up(lambda event: True)
        for _ in range(4):
            session.step(timed=True)
        measurement = session.finish()
    finally:
        workload.close()
    assert session.restarts >= 1 and session.script_steps == 3  # (a step is reported as the next begins)
    assert measurement.notes == [
        "the script trains a new model once done with the first (k-fold's next fold): each run measured "
        f"its first 3 steps, started again {session.restarts} time(s), each warmed up untimed"
    ], measurement.notes


def test_a_k_fold_script_too_short_to_measure_says_it_ends_at_its_second_model():
    """A k-fold script whose folds are one step each ends its run at the second fold's optimizer,
    before a step can be timed: the error said "the script ended before ... (exit 0)", as of a
    script whose loop ended, and the Ending its agent sent was lost."""
    from mixprec.frameworks.script import ScriptWorkload
    from mixprec.frameworks.script.session import ScriptRanOut, ScriptSession
    from mixprec.frameworks.session import BenchSettings
    from mixprec.policy import Candidate

    kfold = Path(__file__).parent / "scripts" / "kfold.py"
    workload = ScriptWorkload.from_command([sys.executable, str(kfold), "--steps", "1"])
    settings = BenchSettings(device="cpu", batch_size=16, warmup=1, adaptive_warmup=False)
    try:
        with pytest.raises(ScriptRanOut) as ran_out:
            session = ScriptSession(workload, Candidate("bf16-mixed", framework="script"), settings)
            session.warm_up(lambda event: True)
            session.step(timed=True)
    finally:
        workload.close()
    assert "the script trains a new model once done with the first (k-fold's next fold)" in str(
        ran_out.value
    ), ran_out.value
