"""The fork server that starts traced script runs (the numerics check's) from a warm interpreter
(mixprec.frameworks.script.forkserver), against the fresh process it stands in for.

Differential: one probe script run both ways, as launch runs a measured script (its own session,
stdin from /dev/null, stdout and stderr to one log, a pipe passed at its number), must see the same
``__name__``, argv, ``sys.path[0]``, working folder, environment and descriptors, and end the same
way: a normal end, ``sys.exit(3)``, ``sys.exit("message")``, an exception, an unhandled
KeyboardInterrupt, a non-daemon thread still running at the end, ``atexit`` handlers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.frameworks.script import forkserver

PY = sys.executable

PROBE = """\
import atexit, json, os, sys, threading, time
out, fd, mode = sys.argv[-3], int(sys.argv[-2]), sys.argv[-1]
def note(**kw):
    with open(out, "a") as f:
        f.write(json.dumps(kw) + "\\n")
note(name=__name__, argv=sys.argv, path0=sys.path[0], cwd=os.getcwd(), x=os.environ.get("PROBE_X"),
     file=__file__, own_session=os.getsid(0) == os.getpid(), stdin=sys.stdin.read(),
     passed=os.read(fd, 100).decode(), inheritable=os.get_inheritable(fd), names=sorted(globals()),
     package=__package__, loader=type(__loader__).__name__, spec=getattr(__spec__, "origin", None))
atexit.register(lambda: note(atexit=True))
print("to stdout")
print("to stderr", file=sys.stderr)
if mode == "thread":
    def late():
        time.sleep(0.3)
        note(thread=True)
    threading.Thread(target=late).start()
elif mode == "exit3":
    sys.exit(3)
elif mode == "message":
    sys.exit("bad config: lr missing")
elif mode == "raise":
    raise ValueError("boom")
elif mode == "interrupt":
    raise KeyboardInterrupt
elif mode == "draw":
    import random, numpy
    note(draws=[random.random(), float(numpy.random.rand())])
elif mode == "sleep":
    time.sleep(60)
"""


@pytest.fixture
def probe(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "probe.py").write_text(PROBE)
    (folder / "probemod.py").write_text(PROBE)
    return folder


def run(folder: Path, command: list[str], mode: str, forked: bool, **env: str) -> tuple[int, str, str]:
    """``command`` run in ``folder`` as launch runs a measured script (its notes' file, a pipe's
    descriptor and ``mode`` its last arguments): its exit code, what it noted, its log."""
    out, log = folder.parent / "notes.jsonl", folder.parent / "log.txt"
    out.unlink(missing_ok=True)
    read, write = os.pipe()
    os.write(write, b"through the pipe")
    os.close(write)
    argv = [*command, str(out), str(read), mode]
    env = {**os.environ, "PROBE_X": "set", **env}
    try:
        with log.open("w") as stdout, open(os.devnull) as stdin:
            if forked:
                process = forkserver.start(
                    argv,
                    cwd=str(folder),
                    env=env,
                    stdin=stdin.fileno(),
                    stdout=stdout.fileno(),
                    pass_fds=[read],
                )
            else:
                process = subprocess.Popen(
                    argv,
                    cwd=folder,
                    env=env,
                    stdin=stdin,
                    stdout=stdout,
                    stderr=subprocess.STDOUT,
                    pass_fds=[read],
                    start_new_session=True,
                )
    finally:
        os.close(read)
    code = process.wait(timeout=120)
    return code, out.read_text(), log.read_text()


@pytest.mark.parametrize("mode", ["end", "thread", "exit3", "message", "raise", "interrupt"])
def test_a_forked_run_sees_and_ends_as_a_fresh_process(probe, mode):
    command = [PY, "probe.py", "--flag"]
    fresh, forked = run(probe, command, mode, False), run(probe, command, mode, True)
    assert forked[0] == fresh[0]
    assert forked[1] == fresh[1]  # what it saw, then the thread's and atexit's notes, in order
    first = json.loads(fresh[1].splitlines()[0])
    assert first["name"] == "__main__" and first["passed"] == "through the pipe" and first["own_session"]
    if mode in ("raise", "interrupt"):  # a traceback: runpy's frames above the script's own
        assert forked[2].splitlines()[-1] == fresh[2].splitlines()[-1]
        assert 'probe.py", line' in forked[2] and forked[2].startswith("to stdout\nto stderr\n")
    else:
        assert forked[2] == fresh[2]


def test_forked_runs_draw_their_own_random_numbers_as_fresh_processes_do(probe):
    """Python's and NumPy's global generators (NumPy's seeded once as torch imported it, in the
    server: copied by every fork unless drawn afresh)."""
    draws = [json.loads(run(probe, [PY, "probe.py"], "draw", True)[1].splitlines()[-2]) for _ in range(2)]
    first, second = (d["draws"] for d in draws)
    assert first[0] != second[0] and first[1] != second[1]


def test_under_pythonsafepath_neither_puts_its_folder_on_the_path(probe):
    """``PYTHONSAFEPATH`` (Python 3.11's ``-P``): no script folder first on ``sys.path``, and the
    server's own ``-c`` left nothing there either."""
    fresh = run(probe, [PY, "probe.py"], "end", False, PYTHONSAFEPATH="1")
    forked = run(probe, [PY, "probe.py"], "end", True, PYTHONSAFEPATH="1")
    assert forked == fresh
    assert json.loads(fresh[1].splitlines()[0])["path0"] != str(probe)


def test_a_module_is_run_as_python_m_runs_it(probe):
    command = [PY, "-m", "probemod"]
    fresh, forked = run(probe, command, "end", False), run(probe, command, "end", True)
    assert forked == fresh
    assert json.loads(fresh[1].splitlines()[0])["path0"] == str(probe)


def test_runs_share_one_server_and_a_running_one_is_polled_waited_for_and_ended(probe, tmp_path):
    argv = [PY, "probe.py", str(tmp_path / "notes.jsonl"), "0", "sleep"]

    def start(x: str) -> forkserver.ForkedChild:
        with open(os.devnull, "r+") as null:
            env = {**os.environ, "PROBE_X": x}
            return forkserver.start(
                argv, cwd=str(probe), env=env, stdin=null.fileno(), stdout=null.fileno(), pass_fds=[]
            )

    first, second = start("set"), start("set")
    server = _parent(first.pid)
    assert _parent(second.pid) == server != os.getpid()  # one warm interpreter forked both
    assert first.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(timeout=0.3)
    first.terminate()
    second.kill()
    assert first.wait(timeout=30) == -signal.SIGTERM and second.wait(timeout=30) == -signal.SIGKILL
    first.kill()  # (ended and reaped: nothing is signalled)
    assert first.poll() == -signal.SIGTERM
    # another environment: another server (what torch reads at import may differ), the idle one ended
    third = start("another")
    assert _parent(third.pid) != server and not Path(f"/proc/{server}").exists()
    third.kill()
    assert third.wait(timeout=30) == -signal.SIGKILL


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize(
    "argv, forked",
    [
        ([PY, "probe.py", "x"], True),
        ([PY, "-m", "probemod"], True),
        ([PY, "-u", "probe.py"], False),  # interpreter options: started as written
        ([PY, "-c", "pass"], False),
        ([PY, "missing.py"], False),  # Python's own error for a file that is not there
        ([PY, "-m"], False),
        (["no-such-python-here", "probe.py"], False),
    ],
)
def test_only_a_plain_script_or_module_is_forked(probe, monkeypatch, argv, forked):
    assert (forkserver.interpreter_to_fork(argv, str(probe)) is not None) == forked
    monkeypatch.setenv(forkserver.SWITCH_ENV, "0")
    assert forkserver.interpreter_to_fork(argv, str(probe)) is None


def test_a_traced_run_is_forked_and_a_timed_one_is_a_fresh_process(tmp_path):
    """The numerics check's runs start warm; the paired sweep's, timed and weighed, start as the
    user's own run does (a forked child's peak RSS leaves out library pages the server touched)."""
    from mixprec.frameworks.script import ScriptWorkload
    from mixprec.frameworks.script.launch import launch
    from mixprec.frameworks.script.messages import Plan

    (tmp_path / "train.py").write_text("print('no step')\n")
    workload = ScriptWorkload.from_command([PY, "train.py"], cwd=tmp_path)
    kinds = {}
    try:
        for mode in ("trace", "measure"):
            child = launch(workload, Plan(mode=mode, candidate={"policy": "fp32"}, steps=1))
            child.process.wait(timeout=120)
            kinds[mode] = type(child.process).__name__
            child.discard()
    finally:
        workload.close()
    assert kinds == {"trace": "ForkedChild", "measure": "Popen"}
