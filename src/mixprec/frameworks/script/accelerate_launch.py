"""``accelerate launch [opts] train.py`` run as Accelerate runs it: the launcher as given, with the
candidate in every process it starts.

What the launch starts is Accelerate's own decision, so it is read with Accelerate's own parser and
checks (its config file, ``--multi_gpu`` / ``--use_fsdp`` / ``--use_deepspeed``, the GPUs it sees):
a multi-process launch (Accelerate runs ``torch.distributed.run`` in its own process) has its ranks;
anything else runs one process, still through the launcher, so the flags the script reads from it
(``--mixed_precision``, ``--cpu``, ``--dynamo_backend``, the config file's) are what it runs with.
Until mixprec 0.3 the script was run as ``python train.py``: without those flags, one rank.

What does not fit this machine is cut down to what does and said, as for torchrun (:mod:`.ranks`);
a measured run takes a free port (``--main_process_port 0``: Accelerate's own way) so a baseline and
a candidate run side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
from collections.abc import Iterator
from pathlib import Path

from mixprec.errors import UsageError
from mixprec.frameworks.script.ranks import (
    Launch,
    fitted,
    options_before,
    python_of,
    read_launch,
    without_options,
)

# Accelerate's options that tie a launch to other machines or one fixed port (value-taking, flags).
_MACHINES = ("--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port", "--rdzv_backend")
_MACHINE_FLAGS = ("--same_network",)
_PROCESSES = ("--num_processes",)


_MODULE = ["-m", "accelerate.commands.launch"]


def is_accelerate_launch(argv: list[str]) -> bool:
    """``accelerate launch ...`` or ``python -m accelerate.commands.launch ...``."""
    return (Path(argv[0]).name == "accelerate" and argv[1:2] == ["launch"]) or argv[1:3] == _MODULE


def accelerate_launch_of(argv: list[str], capacity: int | None = None) -> Launch | None:
    """The :class:`Launch` of ``accelerate launch ...``; None where Accelerate does not import in
    mixprec's interpreter (the caller then runs the script as one process, and says so). A
    UsageError names a launch Accelerate itself refuses."""
    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    except ImportError:
        return None
    rest = argv[3:] if argv[1:3] == _MODULE else argv[2:]
    args = read_launch(launch_command_parser().parse_args, rest, argv, "accelerate launch")
    script = [args.training_script, *args.training_script_args]
    options = options_before(rest, script, argv)
    if args.no_python:
        raise UsageError(
            f"{shlex.join(argv)}: --no_python runs a program, not a Python script mixprec can put a "
            "candidate into; launch the Python script itself (accelerate launch ... train.py)"
        )
    try:
        with _quiet():  # (its "values were not passed" warning is the user's own launch talking)
            decided, _, _ = _validate_launch_command(argparse.Namespace(**vars(args)))
    except ValueError as exc:
        raise UsageError(f"{shlex.join(argv)}: accelerate refuses it: {exc}") from None
    # (these go through torch.distributed.run in Accelerate's process; DeepSpeed's does on one
    # machine, which is what runs here)
    kinds = (decided.multi_gpu, decided.use_fsdp, decided.use_megatron_lm, decided.use_deepspeed)
    multi = not decided.cpu and any(kinds)
    notes: list[str] = []
    machines = int(decided.num_machines or 1)
    world = max(int(decided.num_processes or 1) // machines, 1) if multi else 1
    if machines > 1:
        options = [*without_options(options, _MACHINES, _MACHINE_FLAGS), "--num_machines", "1"]
        notes.append(
            f"a launch over {machines} machines: one machine runs here (its processes and their "
            "communication, not the network between machines)"
        )
    world = fitted(world, capacity, "accelerate launch", "processes", notes)
    if multi and world == 1:  # (--multi_gpu with one process is refused by Accelerate)
        options = without_options(options, (), ("--multi_gpu",))
    if multi and (machines > 1 or str(world) != str(decided.num_processes)):
        options = [*without_options(options, _PROCESSES, ()), "--num_processes", str(world)]
    prefix = [argv[0] if argv[1:3] == _MODULE else python_of(argv[0]), *_MODULE]
    command = (*prefix, *options, *script)
    measured = command
    if world > 1:
        port = ("--main_process_port", "0")  # a free one, picked by Accelerate
        measured = (*prefix, *without_options(options, ("--main_process_port",), ()), *port, *script)
    return Launch(command, measured, world, tuple(script), notes, bool(args.module), launcher="accelerate")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    logger = logging.getLogger("accelerate.commands.launch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
