"""Hardening (issue 14): nothing a user measured is lost, no input crashes with a traceback, no
file is clobbered. One test (or a parametrised group) per defect class of the issue; each fails on
the code before the fix. The random-input tier is tests/test_fuzz.py."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec.cli import main
from mixprec.errors import CacheWarning, NonFiniteGradientsError, PolicyError, UsageError
from mixprec.files import OutputLock, atomic_write_text, lock_path
from mixprec.measure.results import BenchRow
from mixprec.measure.rowstore import RowStore, encode, read_jsonl, scan
from mixprec.measure.sweep import bench
from mixprec.policy import Candidate
from mixprec.tuning.cache import autotune, autotune_key, read_cache, write_cache
from mixprec.workload.loader import load_workload

SRC = Path(__file__).resolve().parents[1] / "src"

# Planted workloads. Failures start at the second call in a process, so an up-front check that
# runs one strict-fp32 step passes and the sweep itself meets them.
FACTORY = textwrap.dedent(
    """
    import sys
    import time
    import torch
    from torch import nn
    import mixprec

    CALLS = [0]

    def _workload(loss_fn):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        def make_batch(batch_size, device):
            x = torch.randn(batch_size, 16, device=device)
            return x, torch.randint(0, 4, (batch_size,), device=device)
        return mixprec.Workload(model=model, make_batch=make_batch, loss_fn=loss_fn, name="planted",
                                default_batch_size=8)

    def ce(model, batch):
        return nn.functional.cross_entropy(model(batch[0]).float(), batch[1])

    def fails_after_first_call():
        def loss_fn(model, batch):
            CALLS[0] += 1
            if CALLS[0] > 1:
                raise RuntimeError("planted failure in every step")
            return ce(model, batch)
        return _workload(loss_fn)

    def nan_after_first_call():
        def loss_fn(model, batch):
            CALLS[0] += 1
            loss = ce(model, batch)
            return loss * float("nan") if CALLS[0] > 1 else loss
        return _workload(loss_fn)

    def huge_allocation_under_bf16():
        def loss_fn(model, batch):
            if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
                torch.empty(2**50)  # the CPU allocator refuses: a RuntimeError, not OutOfMemoryError
            return ce(model, batch)
        return _workload(loss_fn)

    def slow():  # (at 0.1 s a step the first row is written ~5 s in, the sweep ends ~8 s later)
        def loss_fn(model, batch):
            time.sleep(0.1)
            return ce(model, batch)
        return _workload(loss_fn)
    """
)

EXITS_AT_IMPORT = "import sys\nsys.exit(0)\n\ndef make():\n    pass\n"

FAST_BENCH = ["--steps", "1", "--warmup", "1", "--min-time", "0", "--device", "cpu", "--in-process"]


@pytest.fixture()
def planted(tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(FACTORY, encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("mixprec: error: "), err
    assert "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("mixprec: error")]
    assert len(errors) == 1, err
    return lines[-1]


# ------------------------------------------------------------------ files clobbered


def test_json_naming_a_symlink_is_refused_and_the_link_and_its_target_are_untouched(tmp_path, capsys):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "env.json"
    link.symlink_to(target)
    assert main(["env", "--device", "cpu", "--json", str(link)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "symbolic link" in line and "precious.txt" in line
    assert link.is_symlink() and target.read_text() == "keep me"


def test_json_naming_a_special_file_is_refused_not_replaced(tmp_path, capsys):
    fifo = tmp_path / "pipe.json"  # a FIFO stands in for /dev/null: neither may become a regular file
    os.mkfifo(fifo)
    assert main(["env", "--device", "cpu", "--json", str(fifo)]) == 2
    assert "is a FIFO" in _one_error_line(capsys.readouterr().err)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.json"]  # no temp file left


def test_atomic_write_refuses_links_and_keeps_a_regular_files_mode(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    path.chmod(0o640)
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o640
    link = tmp_path / "link.txt"
    link.symlink_to(path)
    with pytest.raises(UsageError, match="symbolic link"):
        atomic_write_text(link, "through the link")
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "out.txt"]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--json", "{d}/r.json", "--csv", "{d}/r.json"], "--json and --csv are the same file"),
        (["--json", "{d}/r.jsonl"], "row stream are the same file"),
        (["--markdown", "{d}/r.jsonl", "--json", "{d}/r.json"], "row stream are the same file"),
    ],
    ids=["json-and-csv", "json-is-its-row-stream", "markdown-on-the-row-stream"],
)
def test_outputs_that_would_overwrite_each_other_are_refused_before_measuring(
    tmp_path, capsys, extra, fragment
):
    existing = tmp_path / "r.jsonl"
    existing.write_text("rows of an earlier run\n")
    argv = ["bench", "--model", "mlp", *FAST_BENCH, *[a.format(d=tmp_path) for a in extra]]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert fragment in _one_error_line(captured.err)
    assert captured.out == ""  # refused before measuring
    assert existing.read_text() == "rows of an earlier run\n"


# ------------------------------------------------------------------ paths checked late


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["bench", "--model", "mlp", *FAST_BENCH, "--plot", "{d}/p.txt"], "'.txt'"),
        (["check", "--model", "mlp", "--device", "cpu", "--plot", "{d}/p"], "no suffix"),
        (["bench", "--model", "mlp", *FAST_BENCH, "--json", "/proc/self/r.json"], "cannot create files"),
        (["env", "--device", "cpu", "--json", "/proc/self/status"], "cannot create files"),
        (["tune", "--model", "mlp", "--device", "cpu", "--report", "{d}/file.txt"], "is a file"),
    ],
    ids=["plot-txt", "plot-no-suffix", "proc-folder", "proc-file", "report-onto-a-file"],
)
def test_bad_output_paths_fail_before_anything_runs(tmp_path, capsys, argv, fragment):
    (tmp_path / "file.txt").write_text("x")
    assert main([a.format(d=tmp_path) for a in argv]) == 2
    captured = capsys.readouterr()
    assert fragment in _one_error_line(captured.err)
    assert captured.out == ""


def test_report_out_onto_a_file_or_unwritable_place_is_one_line(tiny_tune_result, tmp_path, capsys):
    from mixprec.report.jsonio import write_json

    results = write_json(tmp_path / "t.json", "tune", tiny_tune_result.env, tiny_tune_result.to_dict())
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    for out in (blocker, "/proc/self/report", results):
        assert main(["report", str(results), "--out", str(out)]) == 2
        _one_error_line(capsys.readouterr().err)
    assert blocker.read_text() == "a file"
    assert json.loads(results.read_text())["kind"] == "tune"


# ------------------------------------------------------------------ resume


def _sweep(jsonl, progress=None, **overrides):
    options = dict(
        policies="fp32,bf16-mixed,fp16-mixed",
        channels_last="off",
        steps=1,
        warmup=1,
        min_time_s=0.0,
        isolate=False,
        device="cpu",
        jsonl=jsonl,
    )
    options.update(overrides)
    return bench(load_workload("mlp"), events=progress, **options)


def _latest_by_key(path):
    return {r.key: r for r in read_jsonl(path)}


def test_resume_after_a_torn_write_has_exactly_the_rows_of_an_uninterrupted_sweep(tmp_path):
    straight = _sweep(tmp_path / "straight.jsonl")

    jsonl = tmp_path / "torn.jsonl"
    finished = []

    def killed_after_two_rows(event):
        if event["event"] == "row":
            finished.append(event["row"])
            if len(finished) == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _sweep(jsonl, killed_after_two_rows)
    # ... and the process died while writing the next row: half a line at the end of the file.
    torn = encode(finished[-1].to_dict())
    with jsonl.open("ab") as f:
        f.write(torn[: len(torn) // 2])

    notes = []
    resumed = _sweep(jsonl, lambda e: notes.append(e["text"]) if e["event"] == "note" else None, resume=True)
    assert any("torn" in n for n in notes) and any("torn" in n for n in resumed.notes)
    assert [(r.label, r.status) for r in resumed.rows] == [(r.label, r.status) for r in straight.rows]
    assert _latest_by_key(jsonl).keys() == _latest_by_key(tmp_path / "straight.jsonl").keys()
    found = scan(jsonl.read_bytes())
    assert found.torn_bytes == 0 and found.skipped == 0  # every line of the file is intact


@pytest.mark.parametrize(
    "bad_line",
    [b"[1, 2, 3]", b"42", b"null", b'"a string"', b"\xff\xfe not utf-8", b'{"policy": "fp32"}'],
    ids=["list", "number", "null", "string", "not-utf8", "row-missing-fields"],
)
def test_resume_skips_lines_that_are_json_but_not_rows(tmp_path, bad_line):
    jsonl = tmp_path / "rows.jsonl"
    _sweep(jsonl, policies="fp32,bf16-mixed")
    lines = jsonl.read_bytes().splitlines(keepends=True)
    jsonl.write_bytes(b"".join([lines[0], bad_line + b"\n", *lines[1:]]))
    result = _sweep(jsonl, policies="fp32,bf16-mixed", resume=True)
    assert [r.status for r in result.rows] == ["ok", "ok"]
    assert any("corrupt line" in n for n in result.notes)


def test_resume_refuses_rows_measured_under_other_settings_naming_them(tmp_path, capsys):
    jsonl = tmp_path / "rows.jsonl"
    _sweep(jsonl, policies="fp32,bf16-mixed")
    before = jsonl.read_bytes()
    with pytest.raises(UsageError, match=r"steps=1 \(now 2\)") as info:
        _sweep(jsonl, policies="fp32,bf16-mixed", steps=2, resume=True)
    assert "--resume-anyway" in str(info.value)
    assert jsonl.read_bytes() == before  # a refused resume changes nothing
    kept = []
    _sweep(
        jsonl,
        lambda e: kept.append(e["row"].label) if e["event"] == "row" and e["resumed"] else None,
        policies="fp32,bf16-mixed",
        steps=2,
        resume=True,
        resume_anyway=True,
    )
    # every row is there: a complete sweep measures nothing, strict fp32's row is kept too (issue 26)
    assert sorted(kept) == ["bf16-mixed", "fp32"]
    assert len(scan(jsonl.read_bytes()).headers) == 2  # a new header marks where other settings begin


def test_resume_refuses_rows_without_a_settings_header(tmp_path):
    jsonl = tmp_path / "old.jsonl"
    row = BenchRow("mlp", Candidate("bf16-mixed"), "cpu", 64, "ok", step_times_ms=(1.0,))
    jsonl.write_text(json.dumps(row.to_dict()) + "\n")  # as mixprec 0.2.dev wrote them
    with pytest.raises(UsageError, match="without a settings header"):
        _sweep(jsonl, policies="fp32,bf16-mixed", resume=True)


def test_two_runs_on_one_output_are_refused_not_interleaved(tmp_path, capsys):
    out = tmp_path / "r.json"
    with OutputLock([lock_path(out)]):  # another mixprec run holds the outputs
        assert main(["bench", "--model", "mlp", *FAST_BENCH, "--json", str(out)]) == 2
        assert "another mixprec run" in _one_error_line(capsys.readouterr().err)
    jsonl = tmp_path / "api.jsonl"
    # an API sweep streaming to the same rows file
    with RowStore(jsonl, {"x": 1}, resume=False), pytest.raises(UsageError, match="another run is writing"):
        _sweep(jsonl)
    assert not lock_path(out).exists()  # released and removed


# ------------------------------------------------------------------ caches


def _cache_with_entry(path: Path, key: str, candidate: object) -> None:
    path.write_text(json.dumps({"schema_version": 2, "entries": {key: {"candidate": candidate}}}))


@pytest.mark.parametrize(
    "content",
    [
        b"[]",
        b"null",
        b"\x00\xff binary",
        b'{"schema_version": 2, "entries": {"k": {"candidate": 3}}}',
        b'{"k": {"config": {"name": "fp32"}}}',
    ],
    ids=["list", "null", "binary", "wrong-schema-entry", "old-unversioned"],
)
def test_unreadable_autotune_cache_is_a_miss_with_one_warning(tmp_path, content):
    path = tmp_path / "autotune.json"
    path.write_bytes(content)
    with pytest.warns(CacheWarning) as record:
        assert read_cache(path) == {}
    assert len(record) == 1 and "\n" not in str(record[0].message)


def test_autotune_survives_every_broken_cache_and_keeps_the_tune(tmp_path, monkeypatch, tiny_tune_result):
    tuned = []
    monkeypatch.setattr("mixprec.tuning.cache.tune", lambda *a, **k: tuned.append(1) or tiny_tune_result)
    workload = load_workload("mlp")
    key = autotune_key(workload, torch.device("cpu"), None)
    path = tmp_path / "autotune.json"
    unknown = {"policy": "fp64-mixed"}
    old_schema = {"schema_version": 1, "entries": {key: {"config": {"name": "bf16-mixed", "device": "cpu"}}}}
    for broken in (b"[]", b"null", b"\x89PNG\r\n", None, unknown, old_schema):
        if isinstance(broken, bytes):
            path.write_bytes(broken)
        elif broken is None:
            path.write_text(json.dumps({"schema_version": 2, "entries": {key: {"candidate": None}}}))
        elif broken is old_schema:  # 1 held only the policy: tuned again rather than half-applied
            path.write_text(json.dumps(old_schema))
        else:
            _cache_with_entry(path, key, broken)
        with pytest.warns(CacheWarning):
            tuned_pick = autotune(workload, device="cpu", cache_path=path)
        assert tuned_pick.candidate == tiny_tune_result.recommendation.candidate
    assert len(tuned) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hit = autotune(workload, device="cpu", cache_path=path)  # a hit now
        assert hit.candidate == tuned_pick.candidate
    assert len(tuned) == 6


def test_autotune_with_a_folder_in_place_of_its_cache_warns_and_leaves_nothing(
    tmp_path, monkeypatch, tiny_tune_result
):
    monkeypatch.setattr("mixprec.tuning.cache.tune", lambda *a, **k: tiny_tune_result)
    path = tmp_path / "autotune.json"
    path.mkdir()
    with pytest.warns(CacheWarning) as record:
        tuned_pick = autotune(load_workload("mlp"), device="cpu", cache_path=path)
    assert tuned_pick.candidate == tiny_tune_result.recommendation.candidate  # the tune is not lost
    assert any("not cached" in str(w.message) for w in record)
    assert [p.name for p in tmp_path.iterdir()] == ["autotune.json"] and path.is_dir()
    assert write_cache(tmp_path / "fresh.json", {}) is True


# ------------------------------------------------------------------ tracebacks


@pytest.mark.parametrize(
    "content",
    [
        b"[1, 2]",
        b"3.5",
        b"null",
        b"\x89PNG\r\n\x1a\n\x00\x00",
        b'{"kind": "tune", "bench": 5}',
        b'{"kind": "tune", "candidates": [7], "recommendation": {"label": 3}}',
    ],
    ids=["list", "number", "null", "binary", "bench-not-an-object", "malformed-candidates"],
)
def test_report_on_anything_but_a_tune_result_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "results.json"
    path.write_bytes(content)
    out = tmp_path / "report"
    assert main(["report", str(path), "--out", str(out)]) == 2
    _one_error_line(capsys.readouterr().err)
    assert not (out / "index.html").exists()


def test_a_failed_command_leaves_no_output_folder_behind(tmp_path, capsys):
    out = tmp_path / "new" / "deeper"
    assert main(["report", str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    assert "does not exist" in _one_error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []  # the folders made for the outputs were removed again


def test_report_on_a_folder_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "is a folder" in _one_error_line(capsys.readouterr().err)


def _trained_fp16_policy():
    policy = mixprec.get_policy("fp16-mixed", device="cpu", init_scale=1024.0)
    model = policy.prepare(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        with policy.autocast():
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        policy.backward(loss)
        policy.step(opt)
        opt.zero_grad()
    return policy


def _bad_states():
    good = _trained_fp16_policy().state_dict()
    yield None, "takes the dict"
    yield [], "takes the dict"
    yield {"policy": "fp16-mixed"}, "'policy' must be the dict"
    yield {**good, "scaler": {**good["scaler"], "scale": "abc"}}, "scale='abc'"
    yield {**good, "scaler": {**good["scaler"], "scale": float("nan")}}, "scale=nan"
    yield {**good, "scaler": {**good["scaler"], "growth_factor": True}}, "growth_factor=True"
    yield {**good, "scaler": {**good["scaler"], "_growth_tracker": -1}}, "_growth_tracker=-1"
    yield {**good, "stats": None}, "'stats' must be a dict"
    yield {**good, "stats": {**good["stats"], "steps": "3"}}, "steps='3'"
    yield {**good, "stats": {**good["stats"], "scale_history": [[0, "x"]]}}, "scale_history"


@pytest.mark.parametrize(("state", "fragment"), list(_bad_states()))
def test_load_state_dict_validates_everything_then_loads_all_or_nothing(state, fragment):
    policy = mixprec.get_policy("fp16-mixed", device="cpu", init_scale=256.0)
    before_scaler, before_stats = policy.scaler.state_dict(), policy.stats.as_dict()
    with pytest.raises(PolicyError, match=re.escape(fragment)):
        policy.load_state_dict(state)
    assert policy.scaler.state_dict() == before_scaler  # nothing loaded, not even the scaler
    assert policy.stats.as_dict() == before_stats


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: mixprec.get_policy("bf16-mixed", device="cpu", keep_fp32=5), "keep_fp32 must be a list"),
        (lambda: mixprec.get_policy("fp16-mixed", device="cpu", init_scale=True), "init_scale=True"),
        (lambda: mixprec.get_policy("fp16-mixed", device="cpu", growth_factor=math.inf), "growth_factor=inf"),
        (
            lambda: mixprec.get_policy("fp16-mixed", device="cpu", max_skips_at_min_scale=True),
            "max_skips_at_min_scale=True",
        ),
        (lambda: mixprec.get_policy("fp16-mixed", device="cpu", min_scale=True), "min_scale=True"),
        (lambda: mixprec.get_policy("bf16-mixed", device="cpu").step(None), "torch.optim.Optimizer"),
        (lambda: mixprec.get_policy("bf16-mixed", device="cpu").step(5), "torch.optim.Optimizer"),
    ],
    ids=[
        "keep_fp32=5",
        "init_scale=True",
        "growth_factor=inf",
        "max_skips=True",
        "min_scale=True",
        "step(None)",
        "step(5)",
    ],
)
def test_option_values_are_type_and_range_checked(call, fragment):
    with pytest.raises(PolicyError, match=re.escape(fragment)):
        call()


def test_finite_check_raises_after_persistent_nonfinite_gradients_instead_of_skipping_forever():
    policy = mixprec.get_policy("bf16-mixed", device="cpu", finite_check=True)
    model = policy.prepare(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepped = []
    with pytest.raises(NonFiniteGradientsError, match="20 consecutive") as info:
        for _ in range(100):
            with policy.autocast():
                loss = model(torch.randn(8, 4)).float().sum() * float("nan")
            policy.backward(loss)
            stepped.append(policy.step(opt))
            opt.zero_grad()
    assert stepped == [False] * 19 and info.value.parameters == ["weight", "bias"]
    assert info.value.exit_code == 4
    # a transient spike resets the count: skipping, then stepping again, never raises
    policy = mixprec.get_policy("bf16-mixed", device="cpu", finite_check=True)
    model = policy.prepare(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(60):
        with policy.autocast():
            loss = model(torch.randn(8, 4)).float().sum() * (float("nan") if i % 15 else 1.0)
        policy.backward(loss)
        policy.step(opt)
        opt.zero_grad()


# ------------------------------------------------------------------ verdicts and exit codes


def test_a_workload_broken_in_strict_fp32_is_the_users_bug_not_a_precision_verdict(planted, capsys):
    argv = ["check", "--workload", f"{planted}:nan_after_first_call", "--device", "cpu", "--steps", "3"]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "the workload itself fails in strict fp32" in line and "nan" in line.lower()
    assert "precision" not in line.split("fails in strict fp32")[1].split(";")[0]


@pytest.mark.slow
def test_sweeps_where_every_row_failed_exit_2_with_the_first_error(planted, capsys, tmp_path):
    target = f"{planted}:fails_after_first_call"
    argv = ["bench", "--workload", target, "--policies", "fp32,bf16-mixed", *FAST_BENCH]
    assert main([*argv, "--json", str(tmp_path / "b.json")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "every candidate failed" in line and "planted failure" in line
    assert json.loads((tmp_path / "b.json").read_text())["rows"]  # what it measured is written anyway
    tune = ["tune", "--workload", target, "--device", "cpu", "--budget", "60", "--no-compile"]
    assert main([*tune, "--steps", "1", "--check-steps", "2", "--no-lint"]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    # the sweep's rows or the strict-fp32 reference of the numerics check: either names the failure
    assert ("every candidate failed" in line or "fails in strict fp32" in line) and "planted failure" in line
    assert "not even strict fp32" not in captured.out + captured.err


@pytest.mark.slow
def test_an_exhausted_budget_says_so_and_exits_5(capsys, tmp_path):
    out = tmp_path / "t.json"
    assert main(["tune", "--model", "mlp", "--device", "cpu", "--budget", "0.001", "--json", str(out)]) == 5
    captured = capsys.readouterr()
    assert "budget exhausted" in _one_error_line(captured.err)
    assert "budget exhausted" in captured.out  # the console says so too
    assert "not even strict fp32" not in captured.out
    data = json.loads(out.read_text())  # what it measured is written, with why it stopped short
    assert data["budget_exhausted"] and "speed sweep" in data["budget_exhausted"]
    assert data["recommendation"] is None or data["recommendation"]["policy"] == "fp32"


def test_a_workload_calling_sys_exit_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "exits.py"
    path.write_text(EXITS_AT_IMPORT)
    assert main(["bench", "--workload", f"{path}:make", *FAST_BENCH]) == 2
    assert "sys.exit(0)" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--model", "mlp", "--policies", "fp32,tf32", *FAST_BENCH],
        ["check", "--model", "mlp", "--policies", "tf32", "--device", "cpu"],
        ["lint", "--model", "mlp", "--policy", "tf32", "--device", "cpu"],
        ["demo", "--policy", "tf32", "--device", "cpu"],
    ],
    ids=["bench", "check", "lint", "demo"],
)
def test_an_explicitly_requested_unsupported_policy_exits_3_in_every_command(argv, capsys):
    assert main(argv) == 3
    captured = capsys.readouterr()
    assert "tf32" in _one_error_line(captured.err) and "not supported on cpu" in captured.err
    assert captured.out == ""


def test_a_failed_huge_allocation_is_an_oom_row(planted):
    result = bench(
        load_workload(f"{planted}:huge_allocation_under_bf16"),
        policies="fp32,bf16-mixed",
        channels_last="off",
        steps=1,
        warmup=1,
        isolate=False,
        device="cpu",
    )
    rows = {r.label: r for r in result.rows}
    assert rows["fp32"].status == "ok"
    assert rows["bf16-mixed"].status == "oom" and "can't allocate memory" in rows["bf16-mixed"].reason


# ------------------------------------------------------------------ signals


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                todo += children
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_sweep(planted: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    argv = [sys.executable, "-m", "mixprec", "bench", "--workload", f"{planted}:slow"]
    argv += ["--policies", "fp32,bf16-mixed,fp16-mixed", "--channels-last", "off", "--steps", "2"]
    argv += ["--warmup", "1", "--min-time", "0", "--device", "cpu", "--json", str(out)]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _wait_for_rows(jsonl: Path, proc: subprocess.Popen, n: int = 1, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if jsonl.exists() and len(read_jsonl(jsonl)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no row in {jsonl} (exit {proc.poll()})")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_keeps_the_rows_prints_the_resume_hint_and_exits_143(planted, tmp_path):
    out = tmp_path / "r.json"
    proc = _start_sweep(planted, out)
    _wait_for_rows(out.with_suffix(".jsonl"), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "rerun with --resume" in err and "mixprec: terminated" in err and "Traceback" not in err
    assert read_jsonl(out.with_suffix(".jsonl"))[0].label == "fp32"
    assert not lock_path(out).exists()


@pytest.mark.parametrize("error", ["EOFError('Ran out of input')", "BrokenPipeError()", "ValueError('real')"])
def test_a_candidate_process_whose_sweep_is_gone_ends_silently(error):
    """CI, 2026-12-01: a sweep SIGKILLed as it asked the fork server for its next candidate left
    that child reading its work from a pipe with no writer; the child's EOFError traceback reached
    the terminal. The fork server's modules (and so every child) end silently on a closed pipe, and
    still print any other error."""
    code = f"import mixprec.measure.preload\nraise {error}"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    if error.startswith("ValueError"):
        assert "Traceback" in done.stderr and "ValueError: real" in done.stderr
    else:
        assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_candidates_orphaned_by_sigkill_stop_silently(planted, tmp_path):
    out = tmp_path / "r.json"
    proc = _start_sweep(planted, out)
    _wait_for_rows(out.with_suffix(".jsonl"), proc)
    children = _descendants(proc.pid)
    assert children, "the sweep runs its candidates in child processes"
    proc.kill()
    _, err = proc.communicate(timeout=60)  # returns once every holder of the pipes has exited
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(c) for c in children):
        time.sleep(0.2)
    assert not any(_alive(c) for c in children)
    assert "Traceback" not in err and "BrokenPipeError" not in err
    with OutputLock([lock_path(out)]):  # the kernel dropped the killed run's lock: a rerun may start
        pass
