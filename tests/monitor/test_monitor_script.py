"""The monitor inside a script run by `mixprec run --monitor -- python train.py` (mixprec.monitor.script):
it watches the script's own model and optimizer and writes the run's record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mixprec.cli import main

SCRIPTS = Path(__file__).parents[1] / "frameworks" / "scripts"


def test_run_with_the_monitor_records_every_step_and_ends_healthy(tmp_path):
    out = tmp_path / "run"
    args = ["run", "--policy", "fp16-mixed", "--monitor", "--every", "4", "--out", str(out), "--"]
    assert main([*args, sys.executable, str(SCRIPTS / "by_hand.py"), "--out", str(tmp_path / "w.pt")]) == 0
    record = json.loads((out / "run.json").read_text())
    assert record["steps"] == 12 and len(record["losses"]) == 12 and record["healthy"] is True
    assert record["candidate"]["policy"] == "fp16-mixed" and record["facts"]["framework"] == "plain"
    assert (out / "events.jsonl").exists() or record["findings"] == []
