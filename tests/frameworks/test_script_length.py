"""Scripts end at their own last step (their --steps, max_iters, epochs), and the strict-fp32 baseline
steps through the whole sweep: a measured session whose script ends starts it again, warmed up
untimed; one too short to warm up again is one line saying so (the H200's `mixprec tune -- python
plain_loop.py` ended with a BrokenPipeError traceback and nothing written when the 200-step script
ended under its baseline)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mixprec.cli import main

SCRIPT = Path(__file__).parent / "scripts" / "plain_loop.py"
SMALL = ["--d-model", "32", "--layers", "1"]


def test_a_script_shorter_than_the_sweep_is_started_again_and_every_row_measured(tmp_path, capsys):
    out = tmp_path / "bench.json"
    command = [sys.executable, str(SCRIPT), "--steps", "25", *SMALL]
    bench = ["bench", "--policies", "fp32,bf16-mixed", "--steps", "3", "--json", str(out)]
    code = main([*bench, "--", *command])
    assert code == 0, capsys.readouterr()
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    fp32 = rows["fp32"]
    # more timed steps than one run of the script has: the baseline's script ran again
    assert fp32["status"] == "ok" and len(fp32["step_times_ms"]) > 25
    said = "the script ended on its own after 24 measured steps: started again"
    assert any(said in note for note in fp32["notes"])
    # the candidate is measured (bf16 may be far slower than fp32 on a CPU without native bf16)
    assert rows["bf16-mixed"]["status"] in ("ok", "pruned"), rows["bf16-mixed"]["reason"]
    assert "Traceback" not in capsys.readouterr().err


def test_a_script_too_short_to_warm_up_again_is_one_line(tmp_path, capsys):
    command = [sys.executable, str(SCRIPT), "--steps", "3", *SMALL]
    code = main(["bench", "--policies", "fp32", "--steps", "3", "--", *command])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert "the script ended on its own after 2 steps, too few to time it again" in err
    assert "give it more steps (its --steps, max_iters or epochs)" in err
