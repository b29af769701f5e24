"""A training script as a workload: the user's command, run unchanged, and what its first run
showed mixprec about it (:class:`ScriptFacts`)."""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.errors import UsageError
from mixprec.frameworks.script.accelerate_launch import accelerate_launch_of, is_accelerate_launch
from mixprec.frameworks.script.deepspeed_launch import deepspeed_launch_of, is_deepspeed_launch
from mixprec.frameworks.script.ranks import Launch, is_torchrun, launch_of

# How reports name what trains the script.
TRAINED_BY = {
    "plain": "its own loop",
    "hf": "the HF Trainer",
    "lightning": "Lightning's Trainer",
    "accelerate": "Accelerate",
}
# The workloads whose scratch folder exists: removed when the command ends.
_OPEN: list[ScriptWorkload] = []
# The launches run whole: each launcher's test and reader (Accelerate's and DeepSpeed's read None
# where they do not import in mixprec's interpreter: their script then runs as one process, said).
_LAUNCHERS: tuple[tuple[Callable[[list[str]], bool], Callable[[list[str]], Launch | None]], ...] = (
    (is_accelerate_launch, accelerate_launch_of),
    (is_deepspeed_launch, deepspeed_launch_of),
    (is_torchrun, launch_of),
)
# Launcher programs whose other forms (not read above) run their .py script as one process, said.
_ONE_RANK = ("accelerate", "deepspeed", "ds")


@dataclass
class ScriptFacts:
    """What the validating run (strict fp32, a few steps) found in the script.

    Attributes:
        framework: what trains: "plain" (its own loop), "hf" (the HF Trainer), "lightning",
            "accelerate".
        own_policy: the precision the script asks for itself, as a policy name (its autocast and
            GradScaler, its framework's flags, its weights' dtype): what "as written" runs.
        own: what it asked for, as recorded (autocast dtypes, a GradScaler, the framework's flags).
        model / modules / params: the model's class, its module names and types, its parameters.
        device: where the model trains.
        samples_per_step: samples an optimizer step trains (the forwards' batch dimensions summed).
        first_losses: the validating run's losses, to tell whether two runs see the same data.
        deterministic: two strict-fp32 runs agree at the first step (None: not compared yet).
        strict_math: the script leaves this device's fp32 math mode at strict IEEE (it sets no
            TF32/bf32 of its own), so as written an fp32 script is the strict-fp32 baseline.
    """

    framework: str
    own_policy: str
    own: dict[str, Any]
    model: str
    modules: list[tuple[str, str]]
    params: list[str]
    device: str
    samples_per_step: int
    first_losses: list[float]
    deterministic: bool | None = None
    strict_math: bool = True

    @property
    def is_baseline(self) -> bool:
        """The script as written is the strict-fp32 baseline (nothing of its own to measure)."""
        return self.own_policy == "fp32" and self.strict_math

    @property
    def module_names(self) -> list[str]:
        return [name for name, _ in self.modules]

    @property
    def has_conv(self) -> bool:
        return any(kind.startswith("Conv") for _, kind in self.modules)


@dataclass
class ScriptWorkload:
    """The user's command (everything after ``--``), run as it is in its own processes.

    Attributes:
        command: the argv mixprec runs (``python train.py ...``; a torchrun, Accelerate or DeepSpeed
            launch as :mod:`.ranks` fits it to this machine).
        given: the command as the user gave it (for messages and ``mixprec run`` lines).
        cwd: the folder it runs in (where mixprec was started).
        notes: what mixprec changed about how it runs (the ranks of a launch).
        env: variables set for its processes (a one-process launch's rank 0 of a world of one).
        launch: a torchrun, Accelerate or DeepSpeed launch run whole (its ranks, the argv of a measured run),
            else None.
        facts: filled by the validating run (:meth:`ScriptFramework.validate_workload`).
    """

    command: tuple[str, ...]
    given: tuple[str, ...]
    cwd: Path
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    facts: ScriptFacts | None = None
    launch: Launch | None = None
    spec: None = None  # no WorkloadSpec: the script's own processes are the candidates' processes
    # the first step's per-layer ranges of each candidate's check run, by (candidate, micro-batch)
    first_ranges: dict[tuple[Any, int | None], Any] = field(default_factory=dict, repr=False)
    _scratch: Path | None = field(default=None, repr=False)

    @property
    def scratch(self) -> Path:
        """mixprec's folder for this script's runs (their plans, logs, working folders), made on
        first use and removed when the command ends (:func:`close_all`, or this process's exit)."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="mixprec-script-"))
            _OPEN.append(self)
        return self._scratch

    def close(self) -> None:
        """Remove the scratch folder; the logs of failed runs stay (in its ``failed/``: an error
        message names them), nothing else."""
        if self._scratch is None or not self._scratch.exists():
            return
        failed = self._scratch / "failed"
        for entry in self._scratch.iterdir():
            if entry != failed:
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        if not failed.exists():
            shutil.rmtree(self._scratch, ignore_errors=True)

    @property
    def world(self) -> int:
        """The ranks each run starts (1: one process)."""
        return self.launch.world if self.launch is not None else 1

    def command_for(self, measured: bool) -> tuple[str, ...]:
        """The argv of a measured or traced run (a launch's own rendezvous), or of the user's run."""
        return self.launch.measured_argv() if measured and self.launch is not None else self.command

    @property
    def launch_record(self) -> dict[str, Any] | None:
        """What a result's JSON says of the launch (the launcher, the world size)."""
        return self.launch.record() if self.launch is not None else None

    @property
    def name(self) -> str:
        argv = self.launch.python_argv if self.launch is not None else list(self.command)
        script = _script_of(argv)
        if script is not None:
            return Path(script).name
        return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else "script"

    @property
    def description(self) -> str:
        framework = f", trained by {TRAINED_BY[self.facts.framework]}" if self.facts else ""
        return f"your script: {shlex.join(self.given)}{framework}"

    @property
    def default_batch_size(self) -> int:
        return self.facts.samples_per_step if self.facts and self.facts.samples_per_step else 1

    @classmethod
    def from_command(
        cls, command: list[str] | tuple[str, ...], cwd: str | Path | None = None
    ) -> ScriptWorkload:
        """The workload of ``command`` (``python train.py ...``, ``train.py ...``, ``torchrun ...
        train.py``); a UsageError naming the command when it is not a Python program."""
        given = tuple(command)
        if not given:
            raise UsageError(
                "nothing after '--': give your training command, e.g. mixprec tune -- python train.py"
            )
        notes: list[str] = []
        env: dict[str, str] = {}
        argv = list(given)
        folder = Path(cwd or os.getcwd()).resolve()
        launch = None
        read = next((read for known, read in _LAUNCHERS if known(argv)), None)
        if read is not None:
            if Path(argv[0]).name not in ("torchrun", *_ONE_RANK):  # (python -m it)
                argv[0] = _interpreter(argv[0])
            launch = read(argv)
        if launch is not None:
            argv, notes = list(launch.command), launch.measured_notes
            preflight([argv[0], *launch.python_argv[1:]], folder)
            return cls(tuple(argv), given, folder, notes, env, launch=launch)
        if read is not None or Path(argv[0]).name in _ONE_RANK:  # (its launcher does not import here)
            argv, note = _one_rank(argv)
            notes.append(note)
            env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}  # (each launch picks its own)
        elif argv[0].endswith(".py"):
            argv = [sys.executable, *argv]
        elif not _is_python(argv[0]):
            raise UsageError(
                f"{argv[0]!r} is not a Python interpreter: mixprec runs Python training scripts "
                f"(python train.py ..., torchrun ... train.py); got {shlex.join(given)}"
            )
        else:
            argv[0] = _interpreter(argv[0])
        preflight(argv, folder)
        return cls(tuple(argv), given, folder, notes, env)


def preflight(argv: list[str], folder: Path) -> None:
    """What can be known of a command in seconds, before any run: the interpreter exists and
    imports torch (at a Python mixprec's agent runs in), and the script it names exists. A wrong
    command is one UsageError naming the fix, not a failed strict-fp32 run minutes later."""
    python = argv[0]
    if shutil.which(python) is None and not Path(python).is_file():
        raise UsageError(
            f"cannot find the interpreter {python!r} (not on PATH): give the python of your environment"
        )
    script = _script_of(argv)
    if script is not None and not (folder / script).is_file():
        raise UsageError(
            f"no such script: {script!r} (in {folder}); check the path after '--' (mixprec runs it from "
            "the folder it was started in)"
        )
    if Path(python).resolve() == Path(sys.executable).resolve():
        return  # mixprec's own interpreter: torch is there
    probe = "import sys, torch; print(sys.version_info >= (3, 11), torch.__version__)"
    try:
        done = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"cannot run the interpreter {python!r}: {exc}") from None
    last = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode != 0:
        raise UsageError(
            f"{python} cannot import torch ({last or 'exit code ' + str(done.returncode)}): give the "
            f"python of the environment your script trains in (mixprec runs in {sys.executable})"
        )
    if not done.stdout.startswith("True"):
        raise UsageError(f"{python} is older than Python 3.11, which mixprec's agent in your script needs")


def _script_of(argv: list[str]) -> str | None:
    """The script file a Python command line runs (None: ``-m module``, ``-c code``)."""
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        if argv[i] in ("-m", "-c"):
            return None
        i += 2 if argv[i] in ("-W", "-X") else 1
    return argv[i] if i < len(argv) and argv[i] != "-" else None


def _is_python(program: str) -> bool:
    name = Path(program).name
    return name.startswith("python") or program == sys.executable


def _interpreter(program: str) -> str:
    """``python`` as the user's shell would find it; mixprec's own interpreter where that is the same."""
    found = shutil.which(program) or program
    return sys.executable if Path(found).resolve() == Path(sys.executable).resolve() else found


def _one_rank(argv: list[str]) -> tuple[list[str], str]:
    """``accelerate launch [opts] train.py args`` (or ``deepspeed``) where its launcher does not
    import in mixprec's interpreter, as one process: ``python train.py args``; the note says one rank
    was measured, and why."""
    launcher, rest = Path(argv[0]).name, argv[1:]
    if rest[:1] == ["-m"] and len(rest) > 1:  # (python -m accelerate.commands.launch, ...)
        launcher, rest = rest[1].split(".")[0], rest[2:]
    if launcher == "accelerate" and rest[:1] == ["launch"]:
        rest = rest[1:]
    script = next((i for i, a in enumerate(rest) if a.endswith(".py")), None)
    if script is None:
        raise UsageError(f"found no .py script in {shlex.join(argv)}: give python train.py ... instead")
    note = (
        f"a distributed launch ({launcher}): one rank measured, as "
        f"python {shlex.join(rest[script:])} (every rank runs the same step; the collective "
        f"communication of more ranks is not measured: {launcher} does not import in "
        f"mixprec's Python, {sys.executable}; install mixprec beside it to run the launch whole)"
    )
    return [sys.executable, *rest[script:]], note


@atexit.register
def close_all() -> None:
    """Remove every script workload's scratch folder (the CLI calls it when a command ends)."""
    while _OPEN:
        _OPEN.pop().close()
