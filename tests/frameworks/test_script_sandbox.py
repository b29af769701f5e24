"""The measured run's working folder (mixprec.frameworks.script.sandbox), in this process: the user's
folder reads as it is, and no write reaches it, whichever way a script writes."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from mixprec.frameworks.script import sandbox


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def boxed(tmp_path, monkeypatch):
    """The user's folder (``home``: a checkpoint, a log, a data folder, a run folder) and the run's
    mirror of it as the working folder, with the sandbox installed; yields (home, run folder)."""
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "runs" / "old").mkdir(parents=True)
    (home / "ckpt.pt").write_bytes(b"the user's checkpoint")
    (home / "train.log").write_text("the user's log\n")
    (home / "data" / "x.txt").write_text("data")
    (home / "runs" / "old" / "model.pt").write_bytes(b"an old run")
    before = snapshot(home)
    run = sandbox.mirror(home, tmp_path / "run")
    monkeypatch.chdir(run)
    restore = sandbox.install(str(home), str(run))
    try:
        yield home, run
    finally:
        restore()
    assert snapshot(home) == before, "a write reached the user's folder"


def test_reads_see_the_users_files(boxed):
    home, _ = boxed
    assert Path("data/x.txt").read_text() == "data"
    with open("ckpt.pt", "rb") as f:
        assert f.read() == b"the user's checkpoint"
    assert os.path.exists(home / "ckpt.pt") and sorted(os.listdir("runs")) == ["old"]


def test_writes_land_in_the_runs_folder(boxed):
    home, run = boxed
    Path("ckpt.pt").write_bytes(b"the run's")  # a mirrored file: replaced, not written through
    with open("train.log", "a") as log:  # appended: copied first
        log.write("the run's line\n")
    os.makedirs("runs/new", exist_ok=True)  # inside a mirrored folder
    torch.save({"w": torch.ones(2)}, "runs/new/model.pt")  # torch's own writer (not Python's open)
    torch.save({"w": torch.zeros(2)}, home / "beside.pt")  # an absolute path into the user's folder
    os.remove("runs/old/model.pt")  # through a mirrored folder
    os.rename("data/x.txt", "data/y.txt")
    assert (run / "ckpt.pt").read_bytes() == b"the run's" and not (run / "ckpt.pt").is_symlink()
    assert (run / "train.log").read_text() == "the user's log\nthe run's line\n"
    assert torch.load(run / "runs" / "new" / "model.pt")["w"].sum() == 2
    # what the run wrote to its own absolute path reads back, there and by the path it used
    assert torch.load(home / "beside.pt")["w"].sum() == 0 and (run / "beside.pt").exists()
    assert not (run / "runs" / "old" / "model.pt").exists() and (run / "data" / "y.txt").exists()


def test_trees_removed_and_temporary_folders_elsewhere_are_untouched(boxed):
    """shutil.rmtree of a mirrored folder removes the run's links; rmtree walks by folder
    descriptors (dir_fd), which a TemporaryDirectory outside the user's folder uses too (Inductor's:
    the sandbox broke it, 'Directory not empty')."""
    shutil.rmtree("runs")
    assert not os.path.exists("runs")
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "a" / "b").mkdir(parents=True)
        (Path(scratch) / "a" / "b" / "f").write_text("x")
    assert not os.path.exists(scratch)


def test_a_script_run_from_the_folder_that_holds_mixprecs_scratch_is_traced(tmp_path, monkeypatch):
    """`cd /tmp && mixprec tune -- python ~/train.py`: mixprec's scratch folder lies in the user's
    folder, and the sandbox moved the agent's trace record into the run's own folder, where the
    parent never found it ("the script does not train in strict fp32: the script ended before 2
    optimizer steps (exit 0)")."""
    import sys

    from mixprec.frameworks.script import ScriptWorkload
    from mixprec.frameworks.script.session import trace
    from mixprec.policy import Candidate

    script = Path(__file__).parent / "scripts" / "plain_loop.py"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the scratch goes here, as /tmp's does
    workload = ScriptWorkload.from_command(
        [sys.executable, str(script), "--steps", "4", "--d-model", "32", "--layers", "1"], cwd=tmp_path
    )
    try:
        assert workload.scratch.parent == tmp_path
        record = trace(workload, Candidate("fp32", framework="script"), 2)
    finally:
        workload.close()
    assert len(record.steps) == 2 and all(s.loss > 0 for s in record.steps)
