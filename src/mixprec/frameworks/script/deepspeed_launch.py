"""``deepspeed [opts] train.py`` run as DeepSpeed runs it: the launcher as given, with the candidate in
every process it starts.

How many processes DeepSpeed starts is its own decision (a hostfile, ``--include`` / ``--exclude``,
``--num_nodes`` / ``--num_gpus``, the devices its accelerator counts: GPUs, or on the CPU one per NUMA
node), so it is read with DeepSpeed's own parser and resource functions. Each process is started as
DeepSpeed starts it (``python -u train.py --local_rank=N ...``, ``RANK`` / ``WORLD_SIZE`` set), so the
script reads the same arguments and environment as in the user's own run. Until mixprec 0.3 the
script was run as ``python train.py``: one rank, without the launcher's ``--local_rank``.

What does not fit this machine is cut down to what does and said, as for torchrun (:mod:`.ranks`):
one machine's worth of a hostfile's (no hostfile, no ssh: this machine's devices), as many processes
as the machine holds. ``--force_multi`` is dropped: pdsh would not carry mixprec's plan to the ranks.
DeepSpeed cannot pick a free port itself (its ranks meet at ``--master_port``, 29500 by default), so
each measured run is given a free one when it starts (:meth:`Launch.measured_argv`): a baseline and
a candidate run side by side.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from pathlib import Path
from typing import Any

from mixprec.errors import UsageError
from mixprec.frameworks.script import ranks
from mixprec.frameworks.script.ranks import Launch, without_options

_MODULE = ["-m", "deepspeed.launcher.runner"]
# What picks hosts and slots (replaced by ``--num_gpus N`` where the launch is cut) and what ties the
# launch to other machines (dropped where one machine runs on its own).
_SLOTS = ("-i", "--include", "-e", "--exclude", "--num_gpus", "--num_nodes")
_MACHINES: tuple[str, ...] = ("-H", "--hostfile", "--master_addr", "--node_rank", "--launcher")
_MACHINES += ("--launcher_args", "--ssh_port")
_MACHINE_FLAGS = ("--no_ssh", "--no_ssh_check", "--force_multi")
_PORT = "--master_port"


def is_deepspeed_launch(argv: list[str]) -> bool:
    """``deepspeed ...`` (or its other name, ``ds``) or ``python -m deepspeed.launcher.runner ...``."""
    return Path(argv[0]).name in ("deepspeed", "ds") or argv[1:3] == _MODULE


def deepspeed_launch_of(argv: list[str], capacity: int | None = None) -> Launch | None:
    """The :class:`Launch` of ``deepspeed ...``; None where DeepSpeed does not import in mixprec's
    interpreter (the caller then runs the script as one process, and says so). A UsageError names a
    launch mixprec cannot run whole, or one DeepSpeed itself refuses."""
    logging.disable(logging.WARNING)  # (its import announces the accelerator; a missing hostfile)
    try:
        from deepspeed.launcher import runner
    except ImportError:
        return None
    else:
        rest = argv[3:] if argv[1:3] == _MODULE else argv[1:]
        args = ranks.read_launch(runner.parse_args, rest, argv, "deepspeed")
        hosts, from_hostfile = _hosts(runner, args, argv)
    finally:
        logging.disable(logging.NOTSET)
    script = [args.user_script, *args.user_args]
    options = ranks.options_before(rest, script, argv)
    refused = (("no_python", "runs a program, not a Python script"), ("autotuning", "runs its own search"))
    for flag, why in refused:
        if getattr(args, flag):
            raise UsageError(
                f"{shlex.join(argv)}: --{flag} {why}; mixprec puts a candidate into a Python training "
                "script: launch the script itself (deepspeed [options] train.py)"
            )
    notes: list[str] = []
    options = without_options(options, (), ("--force_multi",))  # (pdsh would not carry mixprec's plan)
    asked = world = len(next(iter(hosts.values())))  # (one machine's processes: the first host's)
    elsewhere = from_hostfile or any(host != "localhost" for host in hosts)
    if elsewhere:  # (no hostfile, no ssh: this machine's devices)
        options = [*without_options(options, (*_MACHINES, *_SLOTS), _MACHINE_FLAGS), "--hostfile=/dev/null"]
        where = f"over {len(hosts)} machines" if len(hosts) > 1 else f"on {next(iter(hosts))}"
        notes.append(f"a launch {where}: one machine's worth runs here (its processes, their communication)")
    world = ranks.fitted(world, capacity, "deepspeed", "processes", notes)
    if elsewhere or world != asked:
        options = [*without_options(options, _SLOTS, ()), f"--num_gpus={world}"]
    prefix = [argv[0] if argv[1:3] == _MODULE else ranks.python_of(argv[0]), *_MODULE]
    command = (*prefix, *options, *script)
    # (a measured run: its own port, and the ranks' output in mixprec's log, where a failure is read)
    measured = (*prefix, *without_options(options, (_PORT, "--enable_each_rank_log"), ()), *script)
    script_ = tuple(script)
    return Launch(command, measured, world, script_, notes, bool(args.module), "deepspeed", port_option=_PORT)


def _hosts(runner: Any, args: argparse.Namespace, argv: list[str]) -> tuple[dict[str, list[int]], bool]:
    """The hosts and slots DeepSpeed's runner (``runner``: its module) would start processes on, and
    whether they came from a hostfile: its ``main``'s reading, in its order (a hostfile, else this
    machine's devices, the visible ones where no filter is given; then the filters), with its
    refusals."""
    try:
        pool, include = runner.fetch_hostfile(args.hostfile), args.include
        from deepspeed.accelerator import get_accelerator

        visible = os.environ.get(get_accelerator().visible_devices_envs()[0], "")
        filtered = args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0
        if not pool and visible and not filtered:
            include = f"localhost:{visible}"
        if (args.num_nodes >= 0 or args.num_gpus >= 0) and (include or args.exclude):
            raise ValueError("Cannot specify num_nodes/gpus with include/exclude")
        from_hostfile = bool(pool)
        if not pool:
            if args.num_nodes > 1:
                raise ValueError("Num nodes is >1 but no extra nodes available via hostfile")
            pool = {"localhost": get_accelerator().device_count()}
        active = runner.parse_inclusion_exclusion(pool, include, args.exclude)
        active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    except (ValueError, AssertionError, KeyError) as exc:
        raise UsageError(f"{shlex.join(argv)}: deepspeed refuses it: {exc}") from None
    if not active or not any(active.values()):
        raise UsageError(f"{shlex.join(argv)}: deepspeed finds no device to start a process on")
    return dict(active), from_hostfile
