"""A distributed launch run whole: ``torchrun [opts] train.py`` (or ``python -m torch.distributed.run``)
with the candidate in every rank (``accelerate launch``'s options are read in :mod:`.accelerate_launch`,
``deepspeed``'s in :mod:`.deepspeed_launch`, into the same :class:`Launch`).

The parent's half (:func:`launch_of`) reads the launcher's options: how many ranks it starts, whether
this machine holds them (a CPU core or a GPU per rank) and whether it spans other nodes. What does not
fit is cut down to what does, and said: one node of a multi-node job, as many ranks as there are
GPUs (or CPU cores); never one rank in silence. A measured run gets its own rendezvous
(``--standalone``: a free port), so a baseline and a candidate run side by side.

The ranks' half (:class:`Ranks`) is what the agent in each rank does for a measured or traced run,
at a step boundary, outside the timed step: one all-reduce makes the step's time the slowest rank's
(the job's pace) and its samples every rank's, and rank 0, the one that talks to the parent, hands
its word (one more step, or stop) to the others, so every rank leaves at the same step and none waits
in a collective for a rank that is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.errors import UsageError

# torchrun's options that take no value (every other one does: ``--opt value`` or ``--opt=value``).
_FLAGS = {
    "--standalone",
    "--no-python",
    "--no_python",
    "-m",
    "--module",
    "--run-path",
    "--run_path",
    "--use-env",
    "--use_env",
    "--virtual-local-rank",
    "--virtual_local_rank",
}
_NPROC = ("--nproc-per-node", "--nproc_per_node")
_NNODES = ("--nnodes",)
# What ties a launch to other nodes or to one fixed port: dropped where one node runs on its own.
_RENDEZVOUS = (
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-id",
    "--rdzv_id",
    "--rdzv-conf",
    "--rdzv_conf",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
    "--node-rank",
    "--node_rank",
)


@dataclass(frozen=True)
class Launch:
    """A launch (torchrun's, Accelerate's, DeepSpeed's) as mixprec runs it.

    Attributes:
        command: the argv of ``mixprec run`` (the user's launch, cut down to what this machine holds).
        measured: the argv of a measured or traced run: its own rendezvous on a free port (where
            the launcher needs the port given, :meth:`measured_argv` adds it).
        world: the ranks it starts.
        script: the script and its arguments (what each rank runs).
        module: the script is a module (``torchrun -m pkg.train``), run as ``python -m`` runs one.
        notes: what was cut down to fit this machine.
        launcher: "torchrun", "accelerate" (:mod:`.accelerate_launch`) or "deepspeed"
            (:mod:`.deepspeed_launch`).
        port_option: the launcher's option for its ranks' port, where it cannot pick a free one
            itself: each measured run is given one (:meth:`measured_argv`).
    """

    command: tuple[str, ...]
    measured: tuple[str, ...]
    world: int
    script: tuple[str, ...]
    notes: list[str] = field(default_factory=list)
    module: bool = False
    launcher: str = "torchrun"
    port_option: str | None = None

    def measured_argv(self) -> tuple[str, ...]:
        """The argv of one measured run: ``measured``, with a free port of its own where the launcher
        needs one given (two launches on one port would meet in one rendezvous)."""
        if self.port_option is None:
            return self.measured
        options = self.measured[: len(self.measured) - len(self.script)]
        return (*options, f"{self.port_option}={free_port()}", *self.script)

    @property
    def python_argv(self) -> list[str]:
        """What each rank runs, as a ``python`` command line (``python train.py ...``, ``python -m
        pkg.train ...``)."""
        return ["python", *(["-m"] if self.module else []), *self.script]

    @property
    def measured_notes(self) -> list[str]:
        """What a measured result says of the launch: what was cut, and how the job's step is read."""
        if self.world == 1:
            return list(self.notes)
        how = (
            f"{self.launcher}: {self.world} ranks, each under the candidate; a step's time is the slowest "
            "rank's and its samples every rank's; the losses compared are rank 0's"
        )
        return [*self.notes, how]

    def record(self) -> dict[str, Any]:
        """What a result's JSON says of the launch."""
        return {"launcher": self.launcher, "world": self.world, "command": shlex.join(self.command)}


def is_torchrun(argv: list[str]) -> bool:
    """``torchrun ...`` or ``python -m torch.distributed.run ...``."""
    return Path(argv[0]).name == "torchrun" or argv[1:3] == ["-m", "torch.distributed.run"]


def launch_of(argv: list[str], capacity: int | None = None) -> Launch:
    """The :class:`Launch` of a torchrun command line; ``capacity``: the ranks this machine holds
    (default: its GPUs where CUDA is there, else its CPU cores). A UsageError names a launch mixprec
    cannot run whole (no script, ``--no-python``)."""
    if Path(argv[0]).name == "torchrun":
        prefix, rest = [python_of(argv[0]), "-m", "torch.distributed.run"], argv[1:]
    else:
        prefix, rest = argv[:3], argv[3:]
    options, script = _split(rest, argv)
    if any(o.split("=")[0] in ("--no-python", "--no_python") for o in options):
        raise UsageError(
            f"{shlex.join(argv)}: --no-python runs a program, not a Python script mixprec can put a "
            "candidate into; launch the Python script itself (torchrun ... train.py)"
        )
    notes: list[str] = []
    nodes = _value(options, _NNODES, "PET_NNODES", "1")
    if nodes not in ("1", "1:1"):
        options = [*_dropped(options, (*_NNODES, *_RENDEZVOUS)), "--standalone"]
        notes.append(
            f"a launch over {nodes} nodes: one node runs here (its ranks and their communication, not "
            "the network between nodes)"
        )
    capacity = capacity or capacity_here()
    asked = _value(options, _NPROC, "PET_NPROC_PER_NODE", "1")
    world = fitted(_ranks(asked, capacity), capacity, f"--nproc-per-node {asked}", "ranks", notes)
    if str(world) != asked:
        options = [*_dropped(options, _NPROC), f"--nproc-per-node={world}"]
    command = (*prefix, *options, *script)
    measured = (*prefix, *_dropped(options, (*_RENDEZVOUS, "--standalone")), "--standalone", *script)
    module = any(o in ("-m", "--module") for o in options)
    return Launch(command, measured, world, tuple(script), notes, module)


def python_of(program: str) -> str:
    """The interpreter a launcher on PATH (``torchrun``, ``accelerate``) runs (its ``#!`` line), else
    mixprec's own."""
    found = shutil.which(program) or program
    try:
        with open(found, "rb") as f:
            first = f.readline().decode(errors="replace").strip()
    except OSError:
        return sys.executable
    python = first[2:].strip().split()[0] if first.startswith("#!") and first[2:].strip() else ""
    if not python or Path(python).name == "env" or not Path(python).exists():
        return sys.executable
    return sys.executable if Path(python).resolve() == Path(sys.executable).resolve() else python


def _split(rest: list[str], argv: list[str]) -> tuple[list[str], list[str]]:
    """torchrun's options (each ``--opt=value``) and the script with its arguments."""
    options, i = [], 0
    while i < len(rest) and rest[i].startswith("-"):
        opt = rest[i]
        if "=" in opt or opt in _FLAGS:
            options.append(opt)
            i += 1
        elif i + 1 < len(rest):
            options.append(f"{opt}={rest[i + 1]}")
            i += 2
        else:
            break
    if i >= len(rest):
        raise UsageError(f"found no script in {shlex.join(argv)}: give torchrun [options] train.py ...")
    return options, rest[i:]


def _value(options: list[str], names: tuple[str, ...], env: str, default: str) -> str:
    found = [o.split("=", 1)[1] for o in options if o.split("=", 1)[0] in names]
    return found[-1] if found else os.environ.get(env, default)


def _dropped(options: list[str], names: tuple[str, ...]) -> list[str]:
    return [o for o in options if o.split("=", 1)[0] not in names]


def _ranks(asked: str, capacity: int) -> int:
    """The ranks ``--nproc-per-node`` asks for (torchrun's ``auto``/``cpu``/``gpu`` counted here)."""
    if asked.isdigit() and int(asked) > 0:
        return int(asked)
    if asked in ("auto", "cpu", "gpu"):
        return capacity if asked != "cpu" else os.cpu_count() or 1
    raise UsageError(f"--nproc-per-node {asked!r}: give a number of ranks (or auto, cpu, gpu)")


def read_launch(
    parse: Callable[[list[str]], argparse.Namespace], rest: list[str], argv: list[str], launcher: str
) -> argparse.Namespace:
    """A launcher's options read by its own parser (``parse``); a UsageError in argparse's words."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # (argparse's own words: the UsageError carries them)
            return parse(rest)
    except SystemExit:
        last = (said.getvalue().strip().splitlines() or [""])[-1]
        raise UsageError(
            f"{launcher} cannot read {shlex.join(argv)} ({last}): give {launcher} [options] train.py ..."
        ) from None


def options_before(rest: list[str], script: list[str], argv: list[str]) -> list[str]:
    """The launcher's options in ``rest``: what comes before ``script`` (the script and its
    arguments as the launcher's parser read them, which drops a ``--``). A ``--`` that ends the
    options is dropped too: mixprec adds options after them, which must not land on the script's
    side; the launcher passes the script the same arguments without it."""
    for i, token in enumerate(rest):
        after = rest[i + 1 :]
        if token == script[0] and (after == script[1:] or (after[:1] == ["--"] and after[1:] == script[1:])):
            return rest[: i - 1] if rest[i - 1 : i] == ["--"] else rest[:i]
    raise UsageError(
        f"cannot tell where the launcher's options end and the script starts in {shlex.join(argv)}: "
        "give the launcher's options, then the script and its arguments"
    )


def without_options(options: list[str], valued: tuple[str, ...], flags: tuple[str, ...]) -> list[str]:
    """``options`` without the named ones (``--opt value``, ``--opt=value``, and the flags), each
    long name matched in both spellings (``--num-gpus``, ``--num_gpus``)."""
    kept, skip = [], False
    for token in options:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        name = "--" + name[2:].replace("-", "_") if name.startswith("--") else name
        if name in flags:
            continue
        if name in valued:
            skip = "=" not in token
            continue
        kept.append(token)
    return kept


def fitted(world: int, capacity: int | None, who: str, what: str, notes: list[str]) -> int:
    """``world`` ranks cut to the ``capacity`` this machine holds (default: :func:`capacity_here`),
    said in ``notes`` (``who`` asks for ``world`` ``what``) where they do not fit."""
    capacity = capacity or capacity_here()
    if world <= capacity:
        return world
    each = "GPU" if cuda() else "CPU core"
    notes.append(
        f"{who} asks for {world} {what} and this machine holds {capacity} (a {each} each): {capacity} "
        "measured"
    )
    return capacity


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port no process listens on now, on any interface (where a rendezvous store binds), and
    not handed out before by this process: a launch takes it seconds later (after its imports), so
    two runs started side by side must not be given the same one meanwhile."""
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def capacity_here() -> int:
    """The ranks this machine holds: a GPU each where CUDA is there, else a CPU core each."""
    import torch

    return torch.cuda.device_count() if cuda() else os.cpu_count() or 1


# ---------------------------------------------------------------------- in the ranks
class Ranks:
    """This process's place in a launch the parent runs whole (the agent's side)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.rank = int(os.environ.get("RANK", "0")) if world > 1 else 0

    @property
    def lead(self) -> bool:
        """Rank 0: it talks to the parent and writes the record."""
        return self.rank == 0

    def joined(self) -> bool:
        """Whether the ranks can agree (the script has initialised its process group)."""
        import torch.distributed as dist

        return self.world > 1 and dist.is_available() and dist.is_initialized()

    def _tensor(self, values: list[float], device: Any) -> Any:
        import torch
        import torch.distributed as dist

        on_nccl = dist.get_backend() == "nccl"
        return torch.tensor(values, dtype=torch.float64, device=device if on_nccl else "cpu")

    def job_step(self, step: Any, device: Any) -> None:
        """The step as the job ran it: the slowest rank's seconds, every rank's samples."""
        if not self.joined():
            return
        import torch.distributed as dist

        seconds = self._tensor([step.seconds], device)
        samples = self._tensor([float(step.samples)], device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        dist.all_reduce(samples)
        step.seconds, step.samples = float(seconds.item()), int(samples.item())

    def agree_stop(self, stop: bool, device: Any) -> bool:
        """Rank 0's word (stop here, or one more step), on every rank."""
        if not self.joined():
            return stop
        import torch.distributed as dist

        flag = self._tensor([float(stop)], device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def most(self, value: float, device: Any) -> float:
        """The largest of every rank's ``value`` (the peak memory of the job's fullest rank)."""
        if not self.joined():
            return value
        import torch.distributed as dist

        held = self._tensor([value], device)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        return float(held.item())

    def own_path(self, path: str) -> str:
        """``path`` for this rank: rank 0's as given, another's with ``.rankN`` before its suffix."""
        if self.lead:
            return path
        p = Path(path)
        return str(p.with_name(f"{p.stem}.rank{self.rank}{p.suffix}"))
