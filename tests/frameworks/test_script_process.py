"""The user's script as a process, as people run it: its folder and files, its stdin and randomness,
its launcher and interpreter flags, its signals, its framework's own callbacks, and `mixprec run`'s
record of it (issue 51's themes 3 to 6, 8 and 10). Each test runs the real commands on real child
processes; the scripts are small so a run takes seconds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from extras import require
from mixprec.cli import main
from mixprec.frameworks import framework_named
from mixprec.frameworks.script import ScriptWorkload
from mixprec.frameworks.script.session import trace
from mixprec.frameworks.script.waiting import wait_run
from mixprec.policy import Candidate

SCRIPTS = Path(__file__).parent / "scripts"
PY = sys.executable
ROOT = Path(__file__).parents[2]

# Three optimizer steps of a small model: what most tests below train.
STEPS = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def mixprec(args: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    """``python -m mixprec ARGS`` in ``cwd``, as a user types it (mixprec from this checkout)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [PY, "-m", "mixprec", *args], cwd=cwd, env=env, text=True, capture_output=True, **kw
    )


def files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (links followed) and a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------- the user's files
def test_measured_runs_never_touch_the_users_folder(tmp_path, monkeypatch):
    """check overwrote the user's ckpt.pt (and under tune two runs wrote it at once): each measured
    run works in a mirror of the folder, reads its files as there, and writes only its own."""
    home = tmp_path / "project"
    shutil.copy(SCRIPTS / "own_files.py", write(home, "own_files.py", ""))
    write(home, "config.json", '{"width": 4, "lr": 0.05}')
    (home / "data").mkdir()
    torch.save({"x": torch.randn(32, 4), "y": torch.randn(32, 1)}, home / "data" / "points.pt")
    torch.manual_seed(9)
    torch.save(torch.nn.Linear(4, 1).state_dict(), home / "ckpt.pt")  # the user's checkpoint
    for name, text in [("train.log", "the user's log\n"), ("runs/notes.txt", "keep\n"), ("stale.txt", "x")]:
        write(home, name, text)
    torch.save({}, home / "beside.pt")
    before = files(home)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.chdir(home)
    code = main(
        ["check", "--policies", "bf16-mixed", "--steps", "2", "--", PY, "own_files.py", "--steps", "4"]
    )
    assert code in (0, 4, 6), code  # the script ran (it reads config.json and data/ by relative path)
    assert files(home) == before  # not one byte of the user's folder changed, nothing was added
    assert list(scratch.iterdir()) == []  # and mixprec left nothing behind in $TMPDIR
    # `mixprec run` is the user's own run: it writes their folder, as the script does without mixprec
    assert (
        main(["run", "--policy", "bf16-mixed", "--out", str(tmp_path / "run"), "--", PY, "own_files.py"]) == 0
    )
    after = files(home)
    assert after["ckpt.pt"] != before["ckpt.pt"] and "stale.txt" not in after
    assert "runs/latest/model.pt" in after and after["beside.pt"] != before["beside.pt"]


def test_mixprec_run_is_the_users_run(tmp_path):
    """Its stdin reaches the script (it was cut off), its randomness is its own (runs meant to
    sample seeds were identical), and run.json lands in --out though the script changes its folder
    (Hydra's shape: the record landed in its run folder and 'nothing was applied')."""
    own = """
        import os, random
        import torch
        answer = input()
        print("got", answer, "draws", random.random(), torch.rand(1).item())
        os.makedirs("outputs/today", exist_ok=True)
        os.chdir("outputs/today")
        """
    write(tmp_path, "train.py", textwrap.dedent(own) + STEPS)
    runs = [
        mixprec(
            ["run", "--policy", "bf16-mixed", "--out", "out", "--", PY, "train.py"], tmp_path, input="7\n"
        )
        for _ in range(2)
    ]
    for done in runs:
        assert done.returncode == 0, done.stderr
        assert "got 7" in done.stdout
    draws = [done.stdout.split("draws")[1] for done in runs]
    assert draws[0] != draws[1]
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["steps"] == 3 and not (tmp_path / "outputs" / "today" / "out").exists()


def test_a_runs_record_is_its_own_and_a_run_that_trains_nothing_fails(tmp_path, capsys):
    """A run that ends with os._exit reported the previous run's run.json as its own; a command
    that never stepped exited 0 with '0 optimizer steps'."""
    out = tmp_path / "out"
    run = ["run", "--policy", "bf16-mixed", "--out", str(out), "--", PY]
    assert main([*run, str(write(tmp_path, "a.py", STEPS))]) == 0
    first = json.loads((out / "run.json").read_text())
    quick = write(tmp_path, "b.py", STEPS.replace("range(3)", "range(2)") + "import os\nos._exit(0)\n")
    assert main([*run, str(quick)]) == 0
    second = json.loads((out / "run.json").read_text())
    assert second["steps"] == 2 and second["pid"] != first["pid"]
    capsys.readouterr()
    never = write(
        tmp_path,
        "c.py",
        "import torch\nm = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n",
    )
    assert main([*run, str(never)]) == 2
    assert "never stepped it" in capsys.readouterr().err
    assert main([*run, str(write(tmp_path, "d.py", "print('no training here')\n"))]) == 2
    assert "ran no optimizer step" in capsys.readouterr().err


def test_a_keep_fp32_typo_is_one_line_naming_the_module(tmp_path, capsys):
    """It was a traceback from inside the script's Optimizer.__init__."""
    script = write(
        tmp_path,
        "enc.py",
        """
        import torch
        model = torch.nn.ModuleDict({"encoder": torch.nn.Linear(4, 8), "head": torch.nn.Linear(8, 1)})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model["head"](model["encoder"](torch.randn(8, 4))).mean().backward()
            opt.step()
        """,
    )
    args = ["run", "--policy", "bf16-mixed", "--keep-fp32", "encoderr", "--out", str(tmp_path / "o"), "--"]
    assert main([*args, PY, str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'encoderr' matches no module" in err[0] and "Did you mean 'encoder'" in err[0]


def test_a_wrong_command_is_answered_before_anything_runs(tmp_path, capsys):
    """A typo in the script's path took 125 s and read 'the script does not train in strict fp32';
    so did an interpreter without torch."""
    assert main(["check", "--policies", "bf16-mixed", "--", PY, str(tmp_path / "trian.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    fake = write(
        tmp_path,
        "bin/python3",
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n",
    )
    fake.chmod(0o755)
    script = write(tmp_path, "train.py", STEPS)
    assert main(["check", "--policies", "bf16-mixed", "--", str(fake), str(script)]) == 2
    err = capsys.readouterr().err
    assert "cannot import torch" in err and "No module named 'torch'" in err


def test_a_command_given_without_the_separator_says_where_it_goes(capsys):
    """`mixprec tune python train.py --steps 300` read --steps as tune's own, then failed on
    'unrecognized arguments'."""
    with pytest.raises(SystemExit) as exc:
        main(["tune", "python", "train.py", "--steps", "300"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "put '--' before it" in err
    assert "mixprec tune -- python train.py --steps 300" in err
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    assert "[-- COMMAND ...]" in capsys.readouterr().out


# ---------------------------------------------------------------------- interpreters and launchers
def test_an_isolated_interpreter_and_a_module_are_run_under_the_candidate(tmp_path, monkeypatch):
    """`python -I train.py` ignores PYTHONPATH, so mixprec's hook never loaded ('ended before 2
    optimizer steps'); `python -m package.module` is the other common shape."""
    write(tmp_path, "train.py", STEPS)
    write(tmp_path, "pkg/__init__.py", "")
    write(tmp_path, "pkg/train.py", STEPS)
    monkeypatch.chdir(tmp_path)
    for command in ([PY, "-I", "train.py"], [PY, "-m", "pkg.train"]):
        assert main(["run", "--policy", "bf16-mixed", "--out", "out", "--", *command]) == 0
        record = json.loads((tmp_path / "out" / "run.json").read_text())
        assert record["steps"] == 3 and record["observed"]["observed_dtype"] == "bfloat16", command


# ---------------------------------------------------------------------- signals
def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_for(path: Path, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
def test_sigterm_while_the_script_is_validated_stops_the_script_too(tmp_path):
    """It left the script running as an orphan (docs/cli.md: children stopped)."""
    pid_file = tmp_path / "side" / "pid"  # (outside the user's folder: the sandbox leaves it be)
    pid_file.parent.mkdir()
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(3600)\n"
    write(tmp_path / "project", "hang.py", code)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen(
        [PY, "-m", "mixprec", "check", "--policies", "bf16-mixed", "--", PY, "hang.py"],
        cwd=tmp_path / "project",
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(pid_file)
    time.sleep(0.2)
    pid = int(pid_file.read_text())
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143, process.stderr.read() if process.stderr else ""
    deadline = time.monotonic() + 30
    while not _gone(pid):
        assert time.monotonic() < deadline, "the script outlived mixprec"
        time.sleep(0.2)


SAVER = """
import sys, time
from pathlib import Path
import torch
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
try:
    while True:
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 2:
            Path("ready").write_text("")
        time.sleep(0.01)
except KeyboardInterrupt:
    time.sleep(1.5)  # a checkpoint that takes time to write
    torch.save(model.state_dict(), "ckpt.pt")
    Path("saved").write_text(str(step))
"""


def _run_at_a_terminal(tmp_path: Path, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """``argv`` as the foreground job of a real terminal (a pty), Ctrl-C typed once it is ready:
    the kernel sends SIGINT to the whole foreground group, as a shell's job gets it. (A killpg
    from the test is not that: it is a user's signal, which mixprec passes on.)"""
    import pty

    pid, master = pty.fork()
    if pid == 0:  # pragma: no cover - the child: session leader with the pty as its terminal
        try:
            os.chdir(tmp_path)
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)  # never back into pytest's code in a forked copy of this worker
    _wait_for(tmp_path / "ready")
    os.write(master, b"\x03")  # Ctrl-C
    output = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child side closed
            break
        if not chunk:
            break
        output += chunk
    _, status = os.waitpid(pid, 0)
    os.close(master)
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


@pytest.mark.parametrize("how", ["terminal", "kill", "twice"])
def test_ctrl_c_reaches_the_script_and_mixprec_waits_for_it(tmp_path, how):
    """The script's own save-on-KeyboardInterrupt was killed mid-write: mixprec lets the script
    finish and stops it only on a second interrupt. 'terminal': Ctrl-C at a terminal (the whole
    process group, once); 'kill': SIGINT to mixprec alone (passed on); 'twice': a second one stops it."""
    write(tmp_path, "saver.py", SAVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [PY, "-m", "mixprec", "run", "--policy", "bf16-mixed", "--out", "out", "--", PY, "saver.py"]
    if how == "terminal":
        code, err = _run_at_a_terminal(tmp_path, argv, env)
    else:
        process = subprocess.Popen(
            argv, cwd=tmp_path, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True
        )
        _wait_for(tmp_path / "ready")
        if how == "kill":
            process.send_signal(signal.SIGINT)
        else:
            os.killpg(process.pid, signal.SIGINT)
            time.sleep(0.5)
            os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=60)
        err = process.stderr.read() if process.stderr else ""
    if how == "twice":
        assert not (tmp_path / "saved").exists() and code != 0, err
        assert "stopping your script" in err
        return
    assert (tmp_path / "saved").exists(), err
    assert torch.load(tmp_path / "ckpt.pt")["weight"].shape == (64, 64)
    assert "waiting for your script to finish" in err


def test_a_signal_another_thread_of_mixprec_takes_is_passed_on_to_the_script(tmp_path):
    """torch starts a thread at import that does not block SIGINT: a SIGINT sent to mixprec while its
    main thread was between two waits landed there, raised KeyboardInterrupt in mixprec, and mixprec
    then waited for a script that never got the signal (both ran on: the full suite's Ctrl-C test
    hung beside other work). Here the signal is sent to such a thread: it reaches the script."""
    ready = tmp_path / "ready"
    sleeper = f"import pathlib, sys, time\npathlib.Path({str(ready)!r}).touch()\ntry:\n    time.sleep(30)\n"
    sleeper += "except KeyboardInterrupt:\n    sys.exit(7)\n"
    child = subprocess.Popen([PY, "-c", sleeper], start_new_session=True)

    def takes_the_signal() -> None:  # (made before wait_run blocks SIGINT: as torch's thread is)
        _wait_for(ready)
        time.sleep(0.3)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    taker = threading.Thread(target=takes_the_signal)
    taker.start()
    said: list[str] = []
    try:
        code, signals = wait_run(child, said.append)
    except KeyboardInterrupt:
        child.kill()
        pytest.fail("the SIGINT was raised in mixprec, not passed on to the script")
    finally:
        taker.join()
    assert (code, signals) == (7, ["SIGINT"]), said
    assert said == ["waiting for your script to finish (interrupt again to stop it)"]


# ---------------------------------------------------------------------- frameworks' own settings
def test_lightning_with_a_scheduler_and_its_own_callbacks_is_measured_and_run(tmp_path, monkeypatch, capsys):
    """configure_optimizers returning a scheduler ('0 optimizer steps'), a ModelCheckpoint beside the
    enable_checkpointing=False mixprec added, a LearningRateMonitor beside logger=False: each
    crashed and read as the script failing in strict fp32. Measured (the strict-fp32 run every
    command starts with, then a candidate's, as check's), and run."""
    require("lightning", "frameworks")
    monkeypatch.chdir(tmp_path)
    command = [PY, str(SCRIPTS / "lightning_module.py"), "--max-steps", "4", "--callbacks", "--scheduler"]
    workload = ScriptWorkload.from_command(command)
    framework_named("script").validate_workload(workload, "cpu", 1)
    record = trace(workload, Candidate("bf16-mixed", framework="script"), 2)
    assert record.facts.framework == "lightning" and record.observed.dtype == "bfloat16"
    workload.close()
    assert not (tmp_path / "ckpts").exists() and not (tmp_path / "logs").exists()  # measured: not written
    assert main(["run", "--policy", "bf16-mixed", "--out", str(tmp_path / "run"), "--", *command]) == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["steps"] == 4 and record["facts"]["framework"] == "lightning"
    # the autocast Lightning runs for mixprec's switch is not the script's own precision (run.json
    # listed it as the script's)
    assert record["facts"]["own"]["autocast"] == [] and record["facts"]["own"]["framework"] == {
        "precision": "32-true"
    }
    assert list((tmp_path / "ckpts").glob("*.ckpt"))  # the user's own run saves its checkpoints


def test_the_hf_trainer_that_loads_its_best_model_at_the_end_is_measured(tmp_path, monkeypatch):
    """save_strategy='no' set beside load_best_model_at_end=True: the Trainer refused the pair."""
    require("transformers", "frameworks")
    monkeypatch.chdir(tmp_path)
    args = ["--output_dir", "hf-out", "--max_steps", "3", "--per_device_train_batch_size", "4"]
    args += ["--eval_strategy", "steps", "--save_strategy", "steps", "--eval_steps", "2", "--save_steps", "2"]
    args += ["--load_best_model_at_end", "--report_to", "none", "--tiny"]
    workload = ScriptWorkload.from_command([PY, str(SCRIPTS / "hf_trainer.py"), *args])
    framework_named("script").validate_workload(workload, "cpu", 1)  # (the strict-fp32 run: it raised)
    assert workload.facts is not None and workload.facts.framework == "hf"
    workload.close()
    assert not (tmp_path / "hf-out").exists()


def test_a_script_that_never_steps_is_said_within_the_budget(tmp_path, monkeypatch, capsys):
    """Validating a script that never steps ignored --budget (a deadline of up to 1,800 s). (14 s:
    the 10 s tune keeps back for its end leave 4, half of them the validating run's.)"""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "prep.py", "import time\nimport torch\nwhile True:\n    time.sleep(0.1)\n")
    assert main(["tune", "--budget", "14", "--", PY, "prep.py"]) == 2
    err = capsys.readouterr().err
    assert (
        "did not finish 2 optimizer steps within" in err and "half of the time the budget had left" in err
    ), err


@pytest.mark.slow
def test_an_interrupted_tune_writes_what_it_measured(tmp_path):
    """Ctrl-C during tune: --json was not written although rows had finished (docs/cli.md promises
    both). The first interrupt stops the search as if the budget were spent and writes the outputs."""
    write(tmp_path, "train.py", STEPS.replace("range(3)", "range(100000)"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen(
        [PY, "-m", "mixprec", "tune", "--budget", "600", "--json", "out.json", "--", PY, "train.py"],
        cwd=tmp_path,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,  # (the summary, a few kB: never enough to fill the pipe)
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None and process.stdout is not None
    lines = []
    for line in process.stderr:  # (the progress lines: one a finished row)
        lines.append(line)
        if line.startswith("fp32: ok"):
            break
    os.killpg(process.pid, signal.SIGINT)  # a Ctrl-C at the terminal
    rest = process.stderr.read() + process.stdout.read()
    assert process.wait(timeout=300) == 130, "".join(lines) + rest
    data = json.loads((tmp_path / "out.json").read_text())
    assert any(r["label"] == "fp32" and r["status"] == "ok" for r in data["bench"]["rows"])
    # said as an interrupt, not as a budget that ran out (it had 590 s left)
    assert data["interrupted"].startswith("stopped after ") and data["budget_exhausted"] is None
    assert "budget ran out" not in rest and "raise --budget" not in rest, rest


def test_dataloader_workers_are_not_the_script(tmp_path, monkeypatch):
    """Forked DataLoader workers carry the agent (fork copies the process) and end with os._exit:
    none of them may write the run's record or take a step; spawned ones never load it."""
    own = """
        import sys
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        if __name__ == "__main__":
            data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
            loader = DataLoader(data, batch_size=16, num_workers=2, multiprocessing_context=sys.argv[1])
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in loader:
                (model(x) - y).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        """
    write(tmp_path, "train.py", textwrap.dedent(own))
    monkeypatch.chdir(tmp_path)
    for method in ("fork",):  # (the default; a spawned worker loads no agent: OWNER_ENV is another pid's)
        assert main(["run", "--policy", "bf16-mixed", "--out", "out", "--", PY, "train.py", method]) == 0
        record = json.loads((tmp_path / "out" / "run.json").read_text())
        assert record["steps"] == 4 and record["observed"]["observed_dtype"] == "bfloat16", method
