"""The micro-batch of a script run: its own batch-size argument rewritten (``--batch-arg NAME``).

``tune --batch auto --batch-arg batch-size -- python train.py --batch-size 64`` keeps 64 samples
per optimizer step (the script's value: the effective batch) and runs each candidate at micro-batch
``m`` as ``python train.py --batch-size m``, with ``64 // m`` micro-batches per optimizer step (the
agent's gradient accumulation: :mod:`.accumulation`, or the framework's own switch). The parent
rewrites the command here, per run; the script is never edited.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence

from mixprec.errors import UsageError
from mixprec.frameworks.script.workload import ScriptWorkload


@dataclasses.dataclass(frozen=True)
class BatchArg:
    """The script's batch-size argument.

    Attributes:
        name: the flag without its dashes (``batch-size`` for ``--batch-size``).
        value: the batch the command gives it: the samples per optimizer step every candidate trains.
    """

    name: str
    value: int

    @property
    def flag(self) -> str:
        return f"--{self.name}"


@dataclasses.dataclass
class BatchedScript(ScriptWorkload):
    """A script whose batch-size argument mixprec rewrites per run (``batch``, set by :func:`batched`)."""

    batch: BatchArg | None = None

    @property
    def default_batch_size(self) -> int:
        """The script's own batch: the effective batch of ``tune --batch auto`` (known before it runs)."""
        return self.batch.value if self.batch is not None else super().default_batch_size


def find(argv: Sequence[str], name: str) -> BatchArg:
    """The value of ``--NAME <int>`` or ``--NAME=<int>`` in ``argv`` (the last one, as argparse
    reads it); a one-line UsageError naming the flag and the fix when there is none."""
    name = name.lstrip("-")
    flag = f"--{name}"
    found: str | None = None
    for i, arg in enumerate(argv):
        if arg == flag:
            found = argv[i + 1] if i + 1 < len(argv) else ""
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1 :]
    command = shlex.join(argv)
    if found is None:
        raise UsageError(
            f"--batch-arg {name}: the command has no {flag} (got {command}); give the batch your script "
            f"trains at on it, e.g. -- python train.py {flag} 64"
        )
    try:
        value = int(found)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(
            f"--batch-arg {name}: {flag} is {found!r} in {command}, not a positive integer; give the "
            f"batch your script trains at, e.g. {flag} 64"
        )
    return BatchArg(name, value)


def rewrite(argv: Sequence[str], name: str, size: int) -> tuple[str, ...]:
    """``argv`` with every ``--NAME <v>`` / ``--NAME=<v>`` set to ``size`` (the rest as it is)."""
    flag = f"--{name}"
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == flag and i + 1 < len(out):
            out[i + 1] = str(size)
        elif arg.startswith(flag + "="):
            out[i] = f"{flag}={size}"
    return tuple(out)


def batched(workload: ScriptWorkload, name: str) -> BatchedScript:
    """``workload`` with its batch-size argument ``--NAME`` found (``--batch-arg NAME``)."""
    if workload.launch is not None:
        raise UsageError(
            f"--batch-arg over a torchrun launch is not measured yet (the accumulation of {workload.world} "
            "ranks); run the script as one process (python train.py ...) to search its micro-batch"
        )
    fields = {f.name: getattr(workload, f.name) for f in dataclasses.fields(workload) if f.init}
    return BatchedScript(**fields, batch=find(workload.given, name))


def arg_of(workload: ScriptWorkload) -> BatchArg | None:
    return workload.batch if isinstance(workload, BatchedScript) else None


def at_size(workload: ScriptWorkload, size: int | None) -> ScriptWorkload:
    """``workload`` whose command runs ``size`` samples per micro-batch (None, or the script's own
    batch: itself). A UsageError where there is no batch argument to rewrite."""
    arg = arg_of(workload)
    if size is None or (arg is not None and size == arg.value):
        return workload
    if arg is None:
        raise UsageError(
            f"a micro-batch of {size} over a script needs --batch-arg NAME: the flag your script takes "
            "its batch size from (e.g. --batch-arg batch-size for python train.py --batch-size 64)"
        )
    return dataclasses.replace(
        workload,
        command=rewrite(workload.command, arg.name, size),
        given=rewrite(workload.given, arg.name, size),
    )


def accumulation(workload: ScriptWorkload, size: int) -> int:
    """Micro-batches of ``size`` per optimizer step that make the script's own batch (1 without a
    batch argument: the script runs its own); a UsageError where ``size`` does not divide it."""
    arg = arg_of(workload)
    if arg is None:
        return 1
    if arg.value % size:
        raise UsageError(
            f"micro-batch {size} does not divide the script's {arg.flag} {arg.value}: every micro-batch "
            "must, so each optimizer step trains the same samples"
        )
    return arg.value // size
