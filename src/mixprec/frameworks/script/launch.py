"""Starting the user's script in a process of its own with mixprec's agent in it.

The child's ``PYTHONPATH`` starts with a folder holding only mixprec's ``sitecustomize``
(``boot/``), which installs the agent (:mod:`mixprec.frameworks.script.agent`) before the script
runs, from the plan the parent wrote (its path in ``MIXPREC_SCRIPT_PLAN``). What the script prints
goes to a log file in the scratch folder; its last lines are what an error shows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mixprec.frameworks.script.agent import OWNER_ENV, PLAN_ENV, Plan
from mixprec.frameworks.script.workload import ScriptWorkload

BOOT = Path(__file__).resolve().parent / "boot"
# "ValueError: ...", "torch._dynamo.exc.InternalTorchDynamoError: KeyError: ..."
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)")
# The folder mixprec is imported from, for an interpreter that does not have it installed.
_MIXPREC_ROOT = Path(__file__).resolve().parents[3]


@dataclasses.dataclass
class Child:
    """One run of the script: its process and its log."""

    process: subprocess.Popen
    log: Path

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
        raised = [line for line in lines if _EXCEPTION.match(line)]
        return raised[-1] if raised else (lines[-1] if lines else "")


def launch(
    workload: ScriptWorkload,
    plan: Plan,
    *,
    pass_fds: Sequence[int] = (),
    inherit_output: bool = False,
) -> Child:
    """Start ``workload``'s command under ``plan``; ``inherit_output``: the script prints to this
    terminal (``mixprec run``) instead of the log."""
    workload.scratch.mkdir(parents=True, exist_ok=True)
    plan = dataclasses.replace(plan, scratch=plan.scratch or str(workload.scratch / "output"))
    fd, path = tempfile.mkstemp(prefix="plan-", suffix=".json", dir=workload.scratch)
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(plan), f)
    env = {**os.environ, **workload.env, PLAN_ENV: path}
    env.pop(OWNER_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BOOT), str(_MIXPREC_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    log = workload.scratch / f"{plan.mode}-{Path(path).stem}.log"
    out = None if inherit_output else log.open("w")
    try:
        process = subprocess.Popen(
            list(workload.command),
            cwd=workload.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            pass_fds=tuple(pass_fds),
        )
    except OSError as exc:
        from mixprec.errors import UsageError

        raise UsageError(f"cannot start {workload.command[0]!r}: {exc.strerror or exc}") from None
    finally:
        if out is not None:
            out.close()
    return Child(process, log)
