"""The user's torchrun launch run whole (issue 54): every rank under the candidate, the monitor's
decisions agreed across them, the launch fitted to this machine and said. Until then mixprec ran
``torchrun --nproc_per_node 2 train.py`` as one process (``world: 1``): half the data, none of the
communication, and a monitor on one rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec.cli import main
from mixprec.errors import UsageError
from mixprec.frameworks.script import ScriptWorkload
from mixprec.frameworks.script.ranks import Ranks, launch_of

PY = sys.executable
DDP = Path(__file__).parents[1] / "frameworks" / "scripts" / "ddp_train.py"
TORCHRUN = [PY, "-m", "torch.distributed.run"]


# ---------------------------------------------------------------------- the launch, read
def test_a_torchrun_launch_is_run_whole_with_its_ranks(tmp_path):
    (tmp_path / "train.py").write_text("")
    workload = ScriptWorkload.from_command(
        [*TORCHRUN, "--nproc_per_node", "2", "train.py", "--lr", "3e-4"], cwd=tmp_path
    )
    assert workload.world == 2 and workload.name == "train.py"
    assert workload.command == (*TORCHRUN, "--nproc_per_node=2", "train.py", "--lr", "3e-4")
    # a measured run has a rendezvous of its own: a baseline and a candidate run side by side
    assert workload.command_for(True) == (
        *TORCHRUN,
        "--nproc_per_node=2",
        "--standalone",
        "train.py",
        "--lr",
        "3e-4",
    )
    assert workload.launch_record == {
        "launcher": "torchrun",
        "world": 2,
        "command": " ".join(workload.command),
    }
    assert "2 ranks" in workload.notes[0] and not workload.env


def test_a_launch_is_cut_to_what_this_machine_holds_and_says_so():
    launch = launch_of(["torchrun", "--nproc-per-node=8", "--master_port", "29400", "train.py"], capacity=2)
    assert launch.world == 2 and launch.command[-2:] == ("--nproc-per-node=2", "train.py")
    assert "asks for 8 ranks and this machine holds 2" in " ".join(launch.notes)
    assert "--master_port=29400" in launch.command and not any("master" in a for a in launch.measured)
    multi = launch_of(
        ["torchrun", "--nnodes", "4", "--rdzv-endpoint", "host:29400", "--nproc_per_node", "2", "t.py"],
        capacity=4,
    )
    assert multi.world == 2 and "--standalone" in multi.command
    assert not any(a.startswith(("--nnodes", "--rdzv")) for a in multi.command)
    assert "over 4 nodes: one node runs here" in multi.notes[0]
    assert launch_of(["torchrun", "--nproc_per_node", "auto", "t.py"], capacity=3).world == 3
    # a module launch: named and checked as python -m runs it (it was looked for as a file)
    module = ScriptWorkload.from_command([*TORCHRUN, "--nproc_per_node", "1", "-m", "json.tool", "--help"])
    assert module.name == "json.tool" and module.launch.python_argv == ["python", "-m", "json.tool", "--help"]


def test_a_launch_mixprec_cannot_run_whole_is_refused_with_the_fix():
    with pytest.raises(UsageError, match="found no script"):
        launch_of(["torchrun", "--nproc_per_node", "2"])
    with pytest.raises(UsageError, match="--no-python runs a program"):
        launch_of(["torchrun", "--no-python", "./train.sh"])
    with pytest.raises(UsageError, match="'many'"):
        launch_of(["torchrun", "--nproc_per_node", "many", "t.py"])


def test_each_rank_keeps_its_own_files(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert Ranks(2).own_path("/o/run.json") == "/o/run.rank1.json"
    assert Ranks(1).own_path("/o/events.jsonl") == "/o/events.jsonl"  # (one process: rank 0)


# ---------------------------------------------------------------------- the launch, run
def _weights(folder: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(folder / f"rank{r}.pt") for r in range(2)]


def _final_loss(output: str) -> float:
    line = next(line for line in output.splitlines() if line.startswith("final loss"))
    return float(line.split()[2])


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_run_rescue_over_torchrun_withholds_a_bad_shard_on_every_rank(tmp_path, capfd):
    """Issue 54's first criterion: rank 1's targets x1000 at step 80. Both ranks train (world 2), a
    finding names the bad batch (data, rank 1, step 80), the update is withheld on both ranks, the
    replicas end identical, and the final loss is within 20% of the same run without the bad batch."""
    shutil.copy(DDP, tmp_path / "ddp_train.py")
    os.chdir(tmp_path)
    clean = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc_per_node", "2", "ddp_train.py", "--steps", "120"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert clean.returncode == 0, clean.stderr[-2000:]
    capfd.readouterr()
    launch = [*TORCHRUN, "--nproc_per_node", "2", "ddp_train.py", "--steps", "120", "--bad-rank", "1"]
    code = main(
        [
            "run",
            "--policy",
            "bf16-mixed",
            "--rescue",
            "--out",
            "out",
            "--",
            *launch,
            "--bad-at",
            "80",
            "--weights",
            "w",
        ]
    )
    said = capfd.readouterr()
    assert code == 0, said.err[-3000:]
    lead = json.loads((tmp_path / "out" / "run.json").read_text())
    other = json.loads((tmp_path / "out" / "run.rank1.json").read_text())
    assert (lead["world"], lead["steps"], other["rank"], other["steps"]) == (2, 120, 1, 120)
    spike = [f for f in other["findings"] if f["kind"] == "spike"]
    assert [(f["step"], f["evidence"]["verdict"], f["evidence"]["rank"]) for f in spike] == [(80, "data", 1)]
    assert 80 in lead["withheld"] and 80 in other["withheld"]
    assert any(f["kind"] == "rescue" and f["evidence"]["decided_by_ranks"] == [1] for f in lead["findings"])
    assert "step 80: spike (rank 1): data" in said.err
    first, second = _weights(tmp_path / "w")
    assert all(torch.equal(first[k], second[k]) for k in first)  # the replicas agree
    assert _final_loss(said.out) <= 1.2 * _final_loss(clean.stdout)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_bench_over_torchrun_measures_every_rank(tmp_path):
    """A measured step is the job's: both ranks' samples (2 x 32), the slowest rank's time; the
    record names the launcher and the world size. (The validating run before the sweep is a traced
    run of every rank: the numerics check's path.)"""
    shutil.copy(DDP, tmp_path / "ddp_train.py")
    os.chdir(tmp_path)
    launch = [*TORCHRUN, "--nproc_per_node", "2", "ddp_train.py", "--steps", "100000"]
    code = main(["bench", "--policies", "bf16-mixed", "--steps", "3", "--json", "b.json", "--", *launch])
    data = json.loads((tmp_path / "b.json").read_text())
    status = {(r["policy"], r["status"]) for r in data["rows"]}
    # (bf16-mixed may be pruned where this CPU emulates bf16 far slower: it ran, on both ranks)
    assert code == 0 and status in [{("fp32", "ok"), ("bf16-mixed", s)} for s in ("ok", "pruned")], [
        r.get("reason") for r in data["rows"]
    ]
    assert data["batch_size"] == 64 and data["env"]["launch"]["world"] == 2


def test_run_over_a_one_rank_launch_reads_its_record(tmp_path, capfd):
    """A 1-rank torchrun launch: rank 0's record names the launcher's pid (mixprec run read it as
    another process's and said the script ran no optimizer step)."""
    shutil.copy(DDP, tmp_path / "ddp_train.py")
    os.chdir(tmp_path)
    launch = [*TORCHRUN, "--nproc_per_node", "1", "ddp_train.py", "--steps", "5"]
    code = main(["run", "--policy", "bf16-mixed", "--out", "out", "--", *launch])
    assert code == 0, capfd.readouterr().err[-2000:]
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert (record["steps"], record["world"]) == (5, 1)
