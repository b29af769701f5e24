"""The CLI contract: one line on stderr per error, exit codes 0/2/3, JSON with schema and env."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import mixprec
from mixprec.cli import main
from mixprec.schema import SCHEMA_VERSION


def test_env_json_reports_policies_and_precision_state(tmp_path, capsys):
    path = tmp_path / "env.json"
    assert main(["env", "--device", "cpu", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["kind"] == "env"
    table = {row["policy"]: row for row in data["policies"]}
    assert set(table) == set(mixprec.POLICY_NAMES)
    assert table["tf32"]["supported"] is False and "compute capability" in table["tf32"]["reason"]
    assert table["fp32"]["supported"] is True
    state = data["env"]["precision_state"]
    assert {"cuda.matmul", "cudnn.conv", "mkldnn.matmul", "NVIDIA_TF32_OVERRIDE", "cudnn.benchmark"} <= set(
        state
    )
    out = capsys.readouterr().out
    assert "policies on cpu" in out and "tf32" in out


def test_env_on_this_machine_matches_its_capabilities():
    info = mixprec.detect("cpu")
    rows = {r: mixprec.check_support(r, info) for r in mixprec.POLICY_NAMES}
    assert not rows["tf32"]
    assert rows["fp32"] and rows["bf16-mixed"] and rows["fp16-mixed"]
    assert bool(rows["bf32"]) == info.native_bf16


def test_demo_trains_and_reports(capsys):
    assert main(["demo", "--device", "cpu", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "mixprec demo" in out and "fp32" in out


def _exit_code(argv):
    """main()'s return value, or the code of the SystemExit argparse raises for usage errors."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize(
    ("argv", "code", "fragment"),
    [
        (["demo", "--policy", "bf16-mix"], 2, "Did you mean 'bf16-mixed'"),
        (["demo", "--policy", "tf32", "--device", "cpu"], 3, "not supported on cpu"),
        (["demo", "--device", "tpu"], 2, "valid: cpu, cuda"),
        (["env", "--bogus"], 2, "unrecognized arguments"),
        (["bench", "--model", "mlp", "--settle", "1.5"], 2, "settle must be a number in [0, 1), got 1.5"),
    ],
)
def test_errors_are_one_line_with_exit_code(argv, code, fragment, capsys):
    assert _exit_code(argv) == code
    err = capsys.readouterr().err.strip()
    assert fragment in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_debug_shows_the_traceback():
    with pytest.raises(mixprec.PolicyError):
        main(["--debug", "demo", "--policy", "bf16-mix"])


@pytest.mark.slow
def test_console_script_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "demo", "--policy", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("mixprec: error: Unknown policy 'nope'")


def test_unwritable_output_fails_before_any_measurement(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert main(["bench", "--model", "mlp", "--json", str(blocker / "out.json")]) == 2
    captured = capsys.readouterr()
    assert "--json" in captured.err and "cannot create folder" in captured.err
    assert captured.out == ""  # no table: it stopped before measuring anything


def test_check_policies_all_lists_what_this_device_cannot_run(tmp_path, capsys):
    """``check --policies all`` was refused on a CPU ("names 'tf32', which is not supported ...
    pass --policies all to list it as unsupported"): it checks every policy but the fp32 reference,
    and a row says why one cannot run here."""
    out = tmp_path / "check.json"
    code = main(["check", "--model", "mlp", "--policies", "all", "--steps", "2", "--json", str(out)])
    rows = {c["policy"]: c for c in json.loads(out.read_text())["candidates"]}
    assert code in (0, 4, 6), capsys.readouterr().err  # (4: bf16-true may fail here, as it should)
    assert set(rows) == set(mixprec.POLICY_NAMES) - {"fp32"}
    assert rows["bf16-mixed"]["verdict"] != "unsupported"
    if not torch.cuda.is_available():  # (check runs on the GPU where there is one)
        assert rows["tf32"]["verdict"] == "unsupported" and "TF32 needs" in rows["tf32"]["reason"]
