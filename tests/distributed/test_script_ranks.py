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

from extras import require
from mixprec.cli import main
from mixprec.errors import UsageError
from mixprec.frameworks.script import ScriptWorkload
from mixprec.frameworks.script import agent as script_agent
from mixprec.frameworks.script.accelerate_launch import accelerate_launch_of
from mixprec.frameworks.script.deepspeed_launch import deepspeed_launch_of
from mixprec.frameworks.script.messages import Plan
from mixprec.frameworks.script.ranks import Ranks, launch_of

PY = sys.executable
DDP = Path(__file__).parents[1] / "frameworks" / "scripts" / "ddp_train.py"
ACCELERATE_LOOP = Path(__file__).parents[1] / "frameworks" / "scripts" / "accelerate_train.py"
DEEPSPEED_LOOP = Path(__file__).parents[1] / "frameworks" / "scripts" / "deepspeed_train.py"
DEEPSPEED = [PY, "-m", "deepspeed.launcher.runner"]
ACCELERATE = [PY, "-m", "accelerate.commands.launch"]
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


def _run(tmp_path: Path, capfd, script: Path, policy: str, launch: list[str]) -> dict:
    """``mixprec run --policy POLICY -- LAUNCH`` in ``tmp_path`` (``script`` copied there): rank 0's
    record, once the run exited 0."""
    shutil.copy(script, tmp_path / script.name)
    os.chdir(tmp_path)
    code = main(["run", "--policy", policy, "--out", "out", "--", *launch])
    assert code == 0, capfd.readouterr().err[-3000:]
    return json.loads((tmp_path / "out" / "run.json").read_text())


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
        [
            *TORCHRUN,
            "--standalone",
            "--nproc_per_node",
            "2",
            "ddp_train.py",
            "--steps",
            "120",
            "--leave-at-once",
        ],
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
    run of every rank: the numerics check's path.) The baseline and the candidate run side by side,
    each launch on a port of its own (``--standalone``): one MASTER_PORT for both failed every
    candidate with EADDRINUSE."""
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
    launch = [*TORCHRUN, "--nproc_per_node", "1", "ddp_train.py", "--steps", "5"]
    record = _run(tmp_path, capfd, DDP, "bf16-mixed", launch)
    assert (record["steps"], record["world"]) == (5, 1)


# ---------------------------------------------------------------------- accelerate launch
def test_an_accelerate_launch_is_read_by_accelerate_and_fitted_to_this_machine():
    """Its processes as Accelerate decides them (--multi_gpu, its config), cut to what the machine
    holds and said; a measured run takes a free port. (It ran one process, without the launcher's
    flags: ``python train.py``.)"""
    require("accelerate", "frameworks")
    given = ["accelerate", "launch", "--multi_gpu", "--num-processes", "8", "--main_process_port", "29400"]
    launch = accelerate_launch_of([*given, "train.py", "--lr", "3e-4"], capacity=2)
    assert (launch.world, launch.launcher, launch.script) == (2, "accelerate", ("train.py", "--lr", "3e-4"))
    # (command[0]: the interpreter of the accelerate on PATH)
    assert launch.command[1:] == (
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--main_process_port",
        "29400",
        "--num_processes",
        "2",
        "train.py",
        "--lr",
        "3e-4",
    )
    assert launch.measured[-5:-2] == ("--main_process_port", "0", "train.py")
    assert "29400" not in launch.measured and "asks for 8 processes" in " ".join(launch.notes)
    two_machines = ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1"]
    given = ["accelerate", "launch", "--multi_gpu", "--num_processes", "4", *two_machines]
    machines = accelerate_launch_of([*given, "-m", "pkg.train"], capacity=4)
    assert machines.world == 2 and machines.module and machines.python_argv == ["python", "-m", "pkg.train"]
    assert "10.0.0.1" not in machines.command and "over 2 machines" in machines.notes[0]
    # one process, through the launcher: its --mixed_precision reaches the script
    given = ["accelerate", "launch", "--mixed_precision", "bf16", "train.py"]
    single = accelerate_launch_of(given, capacity=2)
    assert single.world == 1 and single.command[-3:] == ("--mixed_precision", "bf16", "train.py")
    # a `--` before the script's arguments: the script gets them as Accelerate gives them
    given = ["accelerate", "launch", "--multi_gpu", "--num_processes", "4", "t.py", "--", "-x"]
    dashed = accelerate_launch_of(given, capacity=2)
    assert dashed.command[3:] == ("--multi_gpu", "--num_processes", "2", "t.py", "-x"), dashed.command
    with pytest.raises(UsageError, match="accelerate refuses it: You need to use at least 2 processes"):
        accelerate_launch_of(["accelerate", "launch", "--multi_gpu", "--num_processes", "1", "t.py"])
    with pytest.raises(UsageError, match="--no_python runs a program"):
        accelerate_launch_of(["accelerate", "launch", "--no_python", "train"])


def test_under_a_launcher_the_agent_goes_into_the_script_process_only(monkeypatch):
    """torchrun's ranks carry LOCAL_RANK; the one process of ``accelerate launch`` without
    --multi_gpu does not, and is known by its command line; the launcher's own process, which
    imports mixprec's sitecustomize too, is neither."""
    plan = Plan("run", {}, launched=True, script=["train.py", "--lr", "1"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cases = {
        (PY, "-u", "train.py", "--lr", "1"): True,
        (PY, "-X", "utf8", "train.py", "--lr", "1"): True,
        (PY, "/venv/bin/accelerate", "launch", "train.py", "--lr", "1"): False,
        (PY, "-m", "accelerate.commands.launch", "train.py", "--lr", "1"): False,
        (PY, "/venv/bin/deepspeed", "--num_gpus", "2", "train.py", "--lr", "1"): False,
        (PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "train.py", "--lr", "1"): False,
        (PY, "-u", "train.py", "--local_rank=0", "--lr", "1"): False,  # (a DeepSpeed rank: LOCAL_RANK below)
        (PY, "train.py", "--lr", "2"): False,
    }
    for argv, rank in cases.items():
        monkeypatch.setattr(sys, "orig_argv", list(argv))
        assert script_agent._a_rank(plan) is rank, argv
    monkeypatch.setenv("LOCAL_RANK", "0")  # (torchrun's and DeepSpeed's ranks carry it)
    for argv in ([PY, "train.py", "--lr", "1"], [PY, "-u", "train.py", "--local_rank=0", "--lr", "1"]):
        monkeypatch.setattr(sys, "orig_argv", argv)
        assert script_agent._a_rank(plan), argv


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_run_over_accelerate_launch_trains_every_process(tmp_path, capfd):
    """``mixprec run -- accelerate launch --multi_gpu --num_processes 2``: both processes train under
    the candidate, in one group (the replicas end equal), each with its record."""
    require("accelerate", "frameworks")
    launch = [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "accelerate_train.py", "--steps", "12"]
    lead = _run(tmp_path, capfd, ACCELERATE_LOOP, "bf16-mixed", [*launch, "--weights", "w"])
    other = json.loads((tmp_path / "out" / "run.rank1.json").read_text())
    assert (lead["world"], lead["steps"], other["rank"], other["steps"]) == (2, 12, 1, 12)
    assert lead["facts"]["framework_flags"] == {"mixed_precision": "bf16"}
    first, second = _weights(tmp_path / "w")
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_run_over_a_one_process_accelerate_launch_keeps_the_launchers_flags(tmp_path, capfd):
    """Without --multi_gpu Accelerate starts one process; mixprec runs it through the launcher, so
    the precision the launch asks for (--mixed_precision bf16) is what the script says it runs as
    written. (It ran ``python train.py``: fp32 as written.)"""
    require("accelerate", "frameworks")
    launch = [*ACCELERATE, "--mixed_precision", "bf16", "accelerate_train.py", "--steps", "3"]
    record = _run(tmp_path, capfd, ACCELERATE_LOOP, "fp32", launch)
    assert (record["world"], record["steps"]) == (1, 3)
    assert record["facts"]["own"]["framework"] == {"mixed_precision": "bf16"}


# ---------------------------------------------------------------------- deepspeed
def test_a_deepspeed_launch_is_read_by_deepspeed_and_fitted_to_this_machine(tmp_path):
    """Its processes as DeepSpeed's runner decides them (hostfile, --num_gpus, --include), cut to
    what the machine holds and said; each measured run its own free port (DeepSpeed's ranks meet at
    a fixed one, 29500 by default: two runs side by side would meet in one rendezvous). (It ran one
    process, ``python train.py``, without the --local_rank DeepSpeed passes.)"""
    require("deepspeed", "frameworks")
    given = ["deepspeed", "--num_gpus", "8", "--master_port", "29400", "train.py", "--lr", "3e-4"]
    launch = deepspeed_launch_of(given, capacity=2)
    assert (launch.world, launch.launcher, launch.script) == (2, "deepspeed", ("train.py", "--lr", "3e-4"))
    assert launch.command[1:] == (
        "-m",
        "deepspeed.launcher.runner",
        "--master_port",
        "29400",
        "--num_gpus=2",
        "train.py",
        "--lr",
        "3e-4",
    )
    assert "deepspeed asks for 8 processes and this machine holds 2" in launch.notes[0]
    measured = launch.measured_argv()
    ports = [a for a in measured if a.startswith("--master_port")]
    assert len(ports) == 1 and int(ports[0].split("=")[1]) > 0 and "29400" not in measured
    assert measured[-3:] == ("train.py", "--lr", "3e-4")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=4\n")
    given = ["deepspeed", "--hostfile", str(hostfile), "--master_addr", "worker-0", "--module", "pkg.train"]
    machines = deepspeed_launch_of(given, capacity=8)
    assert machines.world == 4 and machines.module and machines.python_argv == ["python", "-m", "pkg.train"]
    assert "worker-0" not in machines.command and str(hostfile) not in machines.command
    assert {"--hostfile=/dev/null", "--num_gpus=4"} <= set(machines.command)
    assert "a launch over 2 machines: one machine's worth runs here" in machines.notes[0]
    # one remote host (a one-line hostfile): no ssh to it, this machine's devices; pdsh's
    # --force_multi dropped (it would not carry mixprec's plan); each rank's log file kept out of a
    # measured run (its exception is read from mixprec's log)
    (tmp_path / "one").write_text("worker-7 slots=2\n")
    given = ["deepspeed", "-H", str(tmp_path / "one"), "--force_multi", "--enable_each_rank_log", "logs"]
    remote = deepspeed_launch_of([*given, "train.py"], capacity=8)
    assert remote.world == 2 and "a launch on worker-7: one machine's worth runs here" in remote.notes[0]
    assert str(tmp_path / "one") not in remote.command and "--force_multi" not in remote.command
    assert "--enable_each_rank_log" in remote.command
    assert "--enable_each_rank_log" not in remote.measured_argv()
    # `--` ending the options, or before the script's own arguments: mixprec's options go before the
    # script, and the script gets the arguments DeepSpeed would give it (it named the script twice)
    for dashed in (["--", "train.py", "--lr", "1"], ["train.py", "--", "--lr", "1"]):
        cut = deepspeed_launch_of(["deepspeed", "--num_gpus", "8", *dashed], capacity=2)
        assert cut.command[3:] == ("--num_gpus=2", "train.py", "--lr", "1"), cut.command
        assert cut.measured_argv()[-3:] == ("train.py", "--lr", "1")
    with pytest.raises(UsageError, match="deepspeed refuses it: Cannot specify num_nodes/gpus"):
        deepspeed_launch_of(["deepspeed", "--num_gpus", "2", "--include", "localhost:0", "t.py"])
    with pytest.raises(UsageError, match="--no_python runs a program"):
        deepspeed_launch_of(["deepspeed", "--no_python", "train"])
    with pytest.raises(UsageError, match="deepspeed cannot read"):
        deepspeed_launch_of(["deepspeed", "--num_gpus", "two", "t.py"])


def test_without_deepspeed_in_mixprecs_python_a_deepspeed_launch_runs_one_rank_and_says_why(
    tmp_path, monkeypatch
):
    """Both spellings: ``python -m deepspeed.launcher.runner`` ran as a plain Python program, the
    agent in the runner's process and in no rank ("the script ran no optimizer step")."""
    (tmp_path / "train.py").write_text("")
    monkeypatch.setitem(sys.modules, "deepspeed.launcher", None)  # (an import of it fails)
    for launcher in (["deepspeed"], DEEPSPEED):
        command = [*launcher, "--num_gpus", "2", "train.py", "--lr", "3e-4"]
        workload = ScriptWorkload.from_command(command, cwd=tmp_path)
        assert workload.command == (PY, "train.py", "--lr", "3e-4") and workload.world == 1
        assert workload.env["WORLD_SIZE"] == "1" and "one rank measured" in workload.notes[0]
        assert "deepspeed does not import in mixprec's Python" in workload.notes[0]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_run_over_a_deepspeed_launch_trains_every_process(tmp_path, capfd):
    """``mixprec run -- deepspeed --num_gpus 2 train.py``: both processes (started by DeepSpeed's
    launcher under its runner, with --local_rank) train under the candidate through the DeepSpeed
    engine, in one group (the replicas end equal), each with its record; rank 0's is found though
    its parent is DeepSpeed's launcher, not the process mixprec started."""
    require("deepspeed", "frameworks")
    launch = [*DEEPSPEED, "--num_gpus", "2", "deepspeed_train.py", "--steps", "12", "--weights", "w"]
    lead = _run(tmp_path, capfd, DEEPSPEED_LOOP, "bf16-mixed", launch)
    other = json.loads((tmp_path / "out" / "run.rank1.json").read_text())
    assert (lead["world"], lead["steps"], other["rank"], other["steps"]) == (2, 12, 1, 12)
    assert lead["observed"]["observed_dtype"] == "bfloat16"
    first, second = _weights(tmp_path / "w")
    assert all(torch.equal(first[k], second[k]) for k in first)
