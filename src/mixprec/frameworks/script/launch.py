"""Starting the user's script in a process of its own with mixprec's agent in it.

The child's ``PYTHONPATH`` starts with a folder holding only mixprec's ``sitecustomize``
(``boot/``), which installs the agent (:mod:`mixprec.frameworks.script.agent`) before the script
runs, from the plan the parent wrote (its path in ``MIXPREC_SCRIPT_PLAN``); an interpreter told to
ignore ``PYTHONPATH`` or ``site`` (``python -I``, ``-E``, ``-S``) gets the agent from a ``-c``
bootstrap that then runs the script as Python would. A measured run works in a folder of its own that
mirrors the user's (:mod:`.sandbox`); what the script prints goes to a log there, whose last lines are
what an error shows. ``mixprec run`` is the user's run: their folder, their terminal, their stdin.
A traced run (the numerics check's) is a child of a warm interpreter, not a fresh process
(:mod:`.forkserver`).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from mixprec.frameworks.script import forkserver
from mixprec.frameworks.script.messages import OWNER_ENV, PLAN_ENV, Plan
from mixprec.frameworks.script.modes import MODES
from mixprec.frameworks.script.ranks import free_port
from mixprec.frameworks.script.workload import ScriptWorkload

BOOT = Path(__file__).resolve().parent / "boot"
# "ValueError: ...", "torch._dynamo.exc.InternalTorchDynamoError: KeyError: ..."
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)")
# The folder mixprec is imported from, for an interpreter that does not have it installed.
_MIXPREC_ROOT = Path(__file__).resolve().parents[3]
_RUNS = itertools.count()
# torchrun's own last word when a rank fails: the rank's exception above it is the reason.
_LAUNCHER_ERROR = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
# the measured runs not yet ended: stopped when mixprec exits
_LIVE: set[subprocess.Popen | forkserver.ForkedChild] = set()
# Python's options that take a value (``-W ignore``, ``-X dev``), and those that keep the agent out
# of PYTHONPATH's reach (isolated, ignore the environment, no site).
_VALUED, _NO_SITE = ("W", "X"), set("IES")
# Runs the script (``sys.argv[1:]``: ``script.py args`` or ``-m module args``) after installing the
# agent, for an interpreter that does not import mixprec's sitecustomize.
_BOOTSTRAP = """\
import sys
sys.path.append({root!r})
from mixprec.frameworks.script.forkserver import run_as_main
del sys.path[-1]
sys.exit(run_as_main(sys.argv[1:]))
"""


@dataclasses.dataclass
class Child:
    """One run of the script: its process, its log and its working folder."""

    process: subprocess.Popen | forkserver.ForkedChild
    log: Path
    folder: Path | None = None  # the run's own folder (its plan, log, working folder, outputs)
    failed_logs: Path | None = None  # where the log goes when the run failed

    def tail(self, lines: int = 12) -> str:
        """The last lines the script printed (stdout and stderr)."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def last_error_line(self) -> str:
        """The exception the script died of (the last ``SomethingError: ...`` line it printed; a
        library's advice after it, such as dynamo's, is not the reason), else its last line."""
        lines = [line.strip() for line in self.tail(60).splitlines() if line.strip()]
        raised = [line for line in lines if _EXCEPTION.match(line) and not line.startswith(_LAUNCHER_ERROR)]
        return raised[-1] if raised else (lines[-1] if lines else "")

    def discard(self, *, keep_log: bool = False) -> None:
        """Remove the run's folder (its outputs, its copy of the user's folder); ``keep_log``: the
        log stays, in the scratch's ``failed/`` folder (an error message names it)."""
        _LIVE.discard(self.process)
        if self.folder is None or not self.folder.exists():
            return
        if keep_log and self.log.exists() and self.failed_logs is not None:
            self.failed_logs.mkdir(parents=True, exist_ok=True)
            kept = self.failed_logs / f"{self.folder.name}.log"
            shutil.move(str(self.log), kept)
            self.log = kept
        shutil.rmtree(self.folder, ignore_errors=True)


def launch(
    workload: ScriptWorkload,
    plan: Plan,
    *,
    pass_fds: Sequence[int] = (),
    inherit_output: bool = False,
) -> Child:
    """Start ``workload``'s command under ``plan``. A measured run ("measure", "trace") works in a
    mirror of the user's folder, with no stdin; ``inherit_output`` (``mixprec run``): the script runs
    in the user's folder with this terminal and this stdin."""
    measured = MODES[plan.mode].sandboxed
    folder = workload.scratch / f"{plan.mode}-{next(_RUNS)}"
    cwd = workload.cwd
    if measured:
        from mixprec.frameworks.script.sandbox import mirror

        cwd = mirror(workload.cwd, folder / "cwd")
        plan = dataclasses.replace(plan, home=str(workload.cwd), own=str(workload.scratch))
    else:
        folder.mkdir(parents=True)
    plan = dataclasses.replace(
        plan,
        scratch=plan.scratch or str(folder / "output"),
        world=workload.world,
        launched=workload.launch is not None,
        script=workload.launch.python_argv[1:] if workload.launch is not None else None,
    )
    plan_path = folder / "plan.json"
    plan.write(plan_path)
    env = {**os.environ, **workload.env, PLAN_ENV: str(plan_path)}
    env.pop(OWNER_ENV, None)
    if "MASTER_PORT" in workload.env:  # each launch its own port: runs side by side do not collide
        env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BOOT), str(_MIXPREC_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    log = folder / "log.txt"
    out = None if inherit_output else log.open("w")
    argv = bootstrapped(list(workload.command_for(measured)))
    process: subprocess.Popen | forkserver.ForkedChild | None = None
    try:
        if MODES[plan.mode].forked and out is not None:
            process = _forked(argv, cwd, env, out, pass_fds)
        if process is None:
            process = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=None if inherit_output else subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                pass_fds=tuple(pass_fds),
                # a measured run is mixprec's: a Ctrl-C at the terminal is mixprec's to handle (it
                # keeps what was measured); the user's own run stays in the terminal's group, as
                # without mixprec
                start_new_session=measured,
            )
    except OSError as exc:
        from mixprec.errors import UsageError

        shutil.rmtree(folder, ignore_errors=True)
        raise UsageError(f"cannot start {workload.command[0]!r}: {exc.strerror or exc}") from None
    finally:
        if out is not None:
            out.close()
    if measured:
        _LIVE.add(process)
    return Child(process, log, folder, workload.scratch / "failed")


def _forked(
    argv: list[str], cwd: Path, env: dict[str, str], out: IO[str], pass_fds: Sequence[int]
) -> forkserver.ForkedChild | None:
    """A traced run forked from a warm interpreter (:mod:`.forkserver`), or None where it starts as
    a fresh process (not a plain ``python script.py``, forking off, no server to be had)."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    try:
        return forkserver.start(
            argv, cwd=str(cwd), env=env, stdin=stdin, stdout=out.fileno(), pass_fds=pass_fds
        )
    except forkserver.ServerGone:
        return None
    finally:
        os.close(stdin)


@atexit.register
def stop_all() -> None:
    """No measured run outlives mixprec (an interrupt, an error anywhere): each is ended now."""
    for process in list(_LIVE):
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        _LIVE.discard(process)


def bootstrapped(argv: list[str]) -> list[str]:
    """``argv`` as run: unchanged, or, for an interpreter whose options keep it from importing
    mixprec's ``sitecustomize`` (``-I``, ``-E``, ``-S``), with a ``-c`` bootstrap that installs the
    agent and then runs the script (or ``-m`` module) as Python would, options kept."""
    options, i = [], 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-", "-c", "-m"):
        flag = argv[i]
        options.append(flag)
        if flag[1:2] in _VALUED and len(flag) == 2 and i + 1 < len(argv):
            options.append(argv[i + 1])
            i += 1
        i += 1
    flags = {c for o in options if o[1:2] not in _VALUED and not o.startswith("--") for c in o[1:]}
    if not flags & _NO_SITE or i >= len(argv) or argv[i] in ("-c", "-"):
        return argv
    return [argv[0], *options, "-c", _BOOTSTRAP.format(root=str(_MIXPREC_ROOT)), *argv[i:]]
