"""A traced run of the user's script started from a warm interpreter: a fork server.

Every start of ``python train.py`` pays for ``import torch`` and, at its first optimizer, for
``torch._dynamo`` (``torch.optim.Optimizer.__init__`` imports it): 3-5 s of a core before the
script's own first line, on each of the runs a check makes (the fp32 reference, its chaos run, one
per candidate, more steps when the reference does not learn yet). The agent imports torch before the
script anyway (sitecustomize), so a process that imported them once and forks one child per run
starts each script in the state a fresh process reaches, less those seconds.

Forked: a traced run (the numerics check's: its figures are losses and gradients) of ``python
script.py ...`` or ``python -m module ...`` with no interpreter options. Started as before: a timed
and weighed run (the paired sweep's: a forked child's peak RSS leaves out the library pages only the
server's imports touched, 0.87 -> 0.47 GB for a tiny CPU step), ``mixprec run`` (the user's own
run), a launcher (torchrun, accelerate, deepspeed), ``python -I`` and the like (the ``-c``
bootstrap), and any run when ``MIXPREC_SCRIPT_FORK=0``. There is one server per interpreter and
environment: the server *is* that interpreter, started with that environment (less mixprec's
per-run variables, which no import reads), so what torch and OpenMP read at import is what a fresh
process reads.

The child runs the script as ``python`` does (:func:`run_as_main`): the environment, working folder,
``sys.argv`` and ``sys.path[0]`` set, the agent installed as the boot ``sitecustomize`` installs it,
NumPy's generator drawn afresh, the script run as ``__main__``, then the interpreter's exit
(non-daemon threads joined, ``atexit`` run, the code ``SystemExit`` carries, 1 with the traceback
for an error, death by SIGINT for an unhandled KeyboardInterrupt). What still tells it from a fresh
process: its parent and its command line (``/proc/self/cmdline``, ``sys.orig_argv``) are the
server's, and so is its string hash seed (a set of strings iterates in one order in every child).

The parent holds a :class:`ForkedChild` where it held a ``subprocess.Popen``; the server is the
child's parent, reaps it and reports its exit code, and delivers the signals the parent sends while
the child lives (a pid is never signalled after it was reaped, so never another process that took
its number).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib
import importlib.machinery
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

SWITCH_ENV = "MIXPREC_SCRIPT_FORK"  # "0": every run is a fresh process
# What every script's process imports before its first optimizer step (the agent imports torch;
# torch.optim imports torch._dynamo). Not the frameworks the agent patches as they are imported
# (Lightning, transformers): the agent must see them imported.
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "mixprec.frameworks.script.agent")
# Variables that differ from run to run and that no import reads, so do not make another server:
# mixprec's own (the agent reads them when it is installed), a launch's port, and pytest's name of
# the test running (a check called from a test suite, mixprec's own among them).
_PER_RUN_PREFIX, _PER_RUN = "MIXPREC_SCRIPT_", ("MASTER_PORT", "PYTEST_CURRENT_TEST")
# One server at a time (each holds torch imported, ~0.5 GB): a check's runs share one environment.
_MAX_SERVERS = 1
# A server with no run to start or watch for this long ends (mixprec used from a notebook keeps its
# process): the next traced run starts another.
IDLE_S = 120.0
START_TIMEOUT_S = 300.0  # the server's imports, on a busy machine
_MESSAGE_BYTES = 1 << 20  # one request (its environment) or reply, whole (SOCK_SEQPACKET)
# (``-c`` puts the server's working folder first on sys.path, unless -P / PYTHONSAFEPATH: the child
# puts its script's folder there instead)
_SERVE = (
    "import sys\nif not sys.flags.safe_path: del sys.path[0]\n"
    "from mixprec.frameworks.script.forkserver import serve\nserve({fd})"
)


class ServerGone(RuntimeError):
    """The server ended or did not answer; the run is started as a fresh process instead."""


def interpreter_to_fork(argv: Sequence[str], cwd: str) -> str | None:
    """The interpreter a server for ``argv`` runs (its absolute path), or None where ``argv`` is not
    ``python script.py ...`` / ``python -m module ...`` without options, or forking is off."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or len(argv) < 2:
        return None
    if argv[1] == "-m":
        if len(argv) < 3 or argv[2].startswith("-"):
            return None
    elif argv[1].startswith("-") or not os.path.isfile(os.path.join(cwd, argv[1])):
        return None  # (options, -c, stdin; a missing file is Python's own error to print)
    found = shutil.which(argv[0])
    return os.path.abspath(found) if found else None


def start(
    argv: Sequence[str], *, cwd: str, env: Mapping[str, str], stdin: int, stdout: int, pass_fds: Sequence[int]
) -> ForkedChild | None:
    """Fork ``argv`` in its own session, its stdin, stdout and stderr on the given descriptors and
    ``pass_fds`` at their numbers; None where it is not to be forked (:func:`interpreter_to_fork`),
    ServerGone if no server could start it."""
    python = interpreter_to_fork(argv, cwd)
    if python is None:
        return None
    server_env = {k: v for k, v in env.items() if not _per_run(k)}
    key = (python, tuple(sorted(server_env.items())))
    with _LOCK:
        server = _SERVERS.pop(key, None)
        if server is None or not server.alive():
            server = _Server(python, server_env)
        _SERVERS[key] = server  # (most recently used last)
        # the least recently used beyond the first few end, once no run of theirs is left to report
        idle = [k for k, other in _SERVERS.items() if k != key and not other.live]
        for old in idle[: max(0, len(_SERVERS) - _MAX_SERVERS)]:
            _SERVERS.pop(old).close()
    request = {"argv": list(argv[1:]), "cwd": cwd, "env": dict(env), "targets": [0, 1, 2, *pass_fds]}
    return server.fork(request, [stdin, stdout, stdout, *pass_fds], list(argv))


def _per_run(name: str) -> bool:
    return name.startswith(_PER_RUN_PREFIX) or name in _PER_RUN


class ForkedChild:
    """A forked run, in place of its ``subprocess.Popen``: ``pid``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill``, with Popen's meanings."""

    def __init__(self, server: _Server, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.returncode = self._server.exit_code(self.pid, 1.0 if left is None else min(left, 1.0))
            if self.returncode is None and left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._server.signal(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """The parent's end of one server: the process, its socket, the exit codes it reported."""

    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [python, "-c", _SERVE.format(fd=theirs.fileno())],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # (a child's output goes to its own log)
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a Ctrl-C at the terminal is mixprec's to handle, not its
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.codes: dict[int, int] = {}
        self.live: set[int] = set()
        self.gone = False
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return not self.gone and self.process.poll() is None

    def fork(self, request: dict[str, Any], fds: list[int], args: list[str]) -> ForkedChild:
        with self.lock:
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            except OSError as exc:
                self._lost()
                raise ServerGone(str(exc)) from None
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:  # (exit codes of other children may come first)
                reply = self._receive(max(0.0, deadline - time.monotonic()))
                if reply is None:
                    self.close()
                    raise ServerGone("the fork server did not answer")
                if "pid" in reply:
                    self.live.add(reply["pid"])
                    return ForkedChild(self, reply["pid"], args)

    def exit_code(self, pid: int, timeout_s: float) -> int | None:
        """``pid``'s exit code once the server reported it, waiting up to ``timeout_s`` for it."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                while pid not in self.codes and self._receive(0.0) is not None:
                    pass  # (what the server already said)
                if pid in self.codes:
                    break
                left = deadline - time.monotonic()
                if self.gone:  # (its children live on without it: wait for the pid to go)
                    if not _exists(pid):
                        self.codes[pid] = -signal.SIGKILL  # (its code went with the server)
                        break
                    if left <= 0:
                        return None
                    time.sleep(min(0.1, left))
                elif left <= 0:
                    return None
                else:
                    self._receive(left)
            self.live.discard(pid)
            return self.codes[pid]

    def signal(self, pid: int, sig: int) -> None:
        """Signal ``pid`` if it has not ended: through the server, which knows, while it lives."""
        with self.lock:
            if pid in self.codes:
                return
            if not self.gone:
                try:
                    self.sock.send(json.dumps({"signal": pid, "number": int(sig)}).encode())
                    return
                except OSError:
                    self._lost()
            if _exists(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)

    def _receive(self, timeout_s: float) -> dict[str, Any] | None:
        """One message from the server (exit codes are recorded as they come); None on a timeout or
        when the server is gone."""
        if self.gone or not select.select([self.sock], [], [], timeout_s)[0]:
            return None
        try:
            data = self.sock.recv(_MESSAGE_BYTES)
        except OSError:
            data = b""
        if not data:
            self._lost()
            return None
        message = json.loads(data)
        if "exit" in message:
            self.codes[message["exit"]] = message["code"]
        return message

    def _lost(self) -> None:
        self.gone = True
        with contextlib.suppress(OSError):
            self.sock.close()

    def close(self) -> None:
        """End the server (its children, each in a session of its own, are left to their owners)."""
        self._lost()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_SERVERS: dict[tuple[str, tuple[tuple[str, str], ...]], _Server] = {}
_LOCK = threading.Lock()


# Registered when this module is imported, before launch.stop_all (which imports it): atexit runs
# last-registered first, so the measured runs still alive are stopped, through their servers, before
# the servers end.
@atexit.register
def close_all() -> None:
    with _LOCK:
        while _SERVERS:
            _SERVERS.popitem()[1].close()


# --- the server's side ---------------------------------------------------------------------------


def serve(fd: int) -> None:
    """The server's loop (``python -c``): import :data:`PRELOAD`, then fork one child per request,
    report each child's exit code, deliver signals to the children alive; end when mixprec closes its
    end of the socket, or after :data:`IDLE_S` with nothing to do."""
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        with contextlib.suppress(Exception):  # (a module that fails here fails in the child, said)
            importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (wakes the select through wake_w)
    live: set[int] = set()
    while True:
        ready = select.select([sock.fileno(), wake_r], [], [], None if live else IDLE_S)[0]
        if not ready and not live:
            return  # (idle: mixprec sees it gone and starts another when it needs one)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        _reap(sock, live)
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _flags, _address = socket.recv_fds(sock, _MESSAGE_BYTES, 64)
        except OSError:
            data, fds = b"", []
        if not data:
            return  # mixprec is gone
        request = json.loads(data)
        if "signal" in request:
            if request["signal"] in live:
                with contextlib.suppress(OSError):
                    os.kill(request["signal"], request["number"])
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, (sock.fileno(), wake_r, wake_w))
        live.add(pid)
        for received in fds:
            os.close(received)
        sock.send(json.dumps({"pid": pid}).encode())


def _reap(sock: socket.socket, live: set[int]) -> None:
    while live:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        live.discard(pid)
        with contextlib.suppress(OSError):
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _child(request: dict[str, Any], fds: list[int], server_fds: Sequence[int]) -> NoReturn:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        os.setsid()  # (a measured run's session of its own, as launch gives a fresh process)
        _place(fds, request["targets"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_entropy()
        code = run_as_main(request["argv"])
    except BaseException:  # (mixprec's own failure to start it: said in the run's log)
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _fresh_entropy() -> None:
    """NumPy's global generator drawn afresh, as a fresh process's is (torch imports NumPy, which
    seeds it once from the OS, and a fork copies it: every child would draw the same numbers).
    Python's ``random`` reseeds itself after a fork; torch's generator starts at the same fixed seed
    in every process anyway."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()


def _place(fds: list[int], targets: list[int]) -> None:
    """Each received descriptor at its target number, inheritable as Popen's ``pass_fds`` are; the
    received copies closed (moved above every number first, so no target overwrites a source)."""
    floor = max([*targets, *fds]) + 1
    high = [_dup_at_least(fd, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for source, target in zip(high, targets, strict=True):
        os.dup2(source, target, inheritable=True)
    for source in high:
        os.close(source)


def _dup_at_least(fd: int, floor: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)


def run_as_main(argv: list[str]) -> int:
    """Run ``argv`` (``script.py args`` or ``-m module args``) under the agent, as the interpreter
    runs its main script, and end as it ends (module docstring); the exit code. Also what launch's
    ``-c`` bootstrap runs for an interpreter that does not import mixprec's sitecustomize."""
    import atexit as exits
    import runpy

    sys.argv = list(argv)
    try:
        from mixprec.frameworks.script.agent import install_from_env

        install_from_env()  # (what the boot sitecustomize does, before sys.path[0] is set)
        if argv[0] == "-m":
            sys.argv = argv[1:]
            if not sys.flags.safe_path:
                sys.path.insert(0, os.getcwd())
            _fresh_main()
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        else:
            if not sys.flags.safe_path:
                sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
            _run_file(argv[0])
        code = 0
    except SystemExit as exc:
        code = _system_exit_code(exc)
    except BaseException as exc:  # what nothing caught, reported as the interpreter reports it
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # (non-daemon threads, as at exit)
    exits._run_exitfuncs()
    if code == -signal.SIGINT:  # an unhandled Ctrl-C ends the process by SIGINT, as Python's does
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _fresh_main() -> types.ModuleType:
    """A ``__main__`` with no name the server defined, as the interpreter's own is at start-up."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    return main


def _run_file(path: str) -> None:
    """Run the script at ``path`` as ``python path`` does: ``__file__`` and its code's file name
    absolute (``runpy.run_path`` keeps the path as given), its loader a ``SourceFileLoader``, no
    ``__spec__``."""
    path = os.path.abspath(path)
    main = _fresh_main()
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __spec__=None,
        __package__=None,
    )
    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _system_exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1
