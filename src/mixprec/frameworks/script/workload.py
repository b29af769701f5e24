"""A training script as a workload: the user's command, run unchanged, and what its first run
showed mixprec about it (:class:`ScriptFacts`)."""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.errors import UsageError

# How reports name what trains the script.
TRAINED_BY = {
    "plain": "its own loop",
    "hf": "the HF Trainer",
    "lightning": "Lightning's Trainer",
    "accelerate": "Accelerate",
}
# Launchers whose script mixprec runs itself, as one process (one rank).
_DISTRIBUTED = ("torchrun", "accelerate", "deepspeed")


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
        command: the argv mixprec runs (``python train.py ...``; a distributed launcher's script run
            as one process).
        given: the command as the user gave it (for messages and ``mixprec run`` lines).
        cwd: the folder it runs in (where mixprec was started).
        notes: what mixprec changed about how it runs (one rank of a distributed launch).
        env: variables set for its processes (a distributed launch's rank 0 of a world of one).
        facts: filled by the validating run (:meth:`ScriptFramework.validate_workload`).
    """

    command: tuple[str, ...]
    given: tuple[str, ...]
    cwd: Path
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    facts: ScriptFacts | None = None
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mixprec-script-")))
    spec: None = None  # no WorkloadSpec: the script's own processes are the candidates' processes

    @property
    def name(self) -> str:
        script = next((a for a in self.command[1:] if not a.startswith("-")), "script")
        if "-m" in self.command[1:2]:
            return self.command[2]
        return Path(script).name

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
        launcher = Path(argv[0]).name
        if launcher in _DISTRIBUTED or argv[:3] == [argv[0], "-m", "torch.distributed.run"]:
            argv, note = _one_rank(argv)
            notes.append(note)
            env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        elif argv[0].endswith(".py"):
            argv = [sys.executable, *argv]
        elif not _is_python(argv[0]):
            raise UsageError(
                f"{argv[0]!r} is not a Python interpreter: mixprec runs Python training scripts "
                f"(python train.py ..., torchrun ... train.py); got {shlex.join(given)}"
            )
        else:
            argv[0] = _interpreter(argv[0])
        return cls(tuple(argv), given, Path(cwd or os.getcwd()), notes, env)


def _is_python(program: str) -> bool:
    name = Path(program).name
    return name.startswith("python") or program == sys.executable


def _interpreter(program: str) -> str:
    """``python`` as the user's shell would find it; mixprec's own interpreter where that is the same."""
    import shutil

    found = shutil.which(program) or program
    return sys.executable if Path(found).resolve() == Path(sys.executable).resolve() else found


def _one_rank(argv: list[str]) -> tuple[list[str], str]:
    """``torchrun [opts] train.py args`` (or ``accelerate launch``, ``deepspeed``) as one process:
    ``python train.py args``; the note says one rank was measured."""
    rest = argv[3:] if argv[1:3] == ["-m", "torch.distributed.run"] else argv[1:]
    if Path(argv[0]).name == "accelerate" and rest[:1] == ["launch"]:
        rest = rest[1:]
    script = next((i for i, a in enumerate(rest) if a.endswith(".py")), None)
    if script is None:
        raise UsageError(f"found no .py script in {shlex.join(argv)}: give python train.py ... instead")
    note = (
        f"a distributed launch ({Path(argv[0]).name}): one rank measured, as "
        f"python {shlex.join(rest[script:])} (every rank runs the same step; the collective "
        "communication of more ranks is not measured)"
    )
    return [sys.executable, *rest[script:]], note


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
