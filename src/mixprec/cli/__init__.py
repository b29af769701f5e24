"""Command-line interface: the only layer that prints or exits.

Errors become one line on stderr and an exit code (the table is in docs/cli.md: 2 usage or a
workload that fails in strict fp32, 3 unsupported, 4 numerics failed, 5 budget exhausted, 130
interrupted, 143 terminated); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, NoReturn

from rich.console import Console

from mixprec.cli import bench, check, demo, env, lint, run, train, tune
from mixprec.cli.outputs import check_outputs
from mixprec.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, MixprecError, MixprecWarning, UsageError
from mixprec.files import OutputLock
from mixprec.quiet import quiet_known_noise

SUBCOMMANDS = (env, demo, bench, check, lint, tune, train, run)
# The commands that take the user's training command after `--` (the script source).
SCRIPT_COMMANDS = ("bench", "check", "tune", "run")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's usage errors: one line, exit 2
        self.exit(2, f"mixprec: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from mixprec.version import __version__

    parser = _Parser(
        prog="mixprec", description="Mixed precision for PyTorch training: apply, measure, verify."
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    for name in SCRIPT_COMMANDS:  # the user's own command goes after '--': the usage line says so
        command = sub.choices[name]
        if command.usage is None:
            auto = command.format_usage().removeprefix("usage: ").strip()
            command.usage = f"{auto} [-- COMMAND ...]"
        command.epilog = (
            f"Your own training script, run unchanged: mixprec {name} [options] -- python train.py ARGS "
            "(everything after '--' is your command)."
        )
    return parser


# What starts a training command: an interpreter, a script, a launcher.
_COMMAND_START = re.compile(r"^(.*/)?(python[0-9.]*|torchrun|accelerate|deepspeed)$|\.py$")


def forgotten_separator(parser: argparse.ArgumentParser, own: Sequence[str]) -> str | None:
    """The error for a training command given without '--' before it (``mixprec tune python
    train.py --steps 300``: argparse would read ``--steps 300`` as tune's own and then refuse
    ``python train.py``), or None."""
    if len(own) < 2 or own[0] not in SCRIPT_COMMANDS:
        return None
    _, unknown = parser.parse_known_args(own)
    start = next((i for i, arg in enumerate(own) if arg in unknown and _COMMAND_START.search(arg)), None)
    if start is None:
        return None
    mine, theirs = own[:start], own[start:]
    return (
        f"{' '.join(theirs[:2])!r} looks like your training command: put '--' before it, as "
        f"mixprec {' '.join([*mine, '--', *theirs])} (everything after '--' is your command; "
        "before it, mixprec's options)"
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so cleanups and the resume hint run as for Ctrl-C."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While a command runs, SIGTERM unwinds like Ctrl-C (children closed, rows kept, a hint)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _one_line_warnings(show: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints mixprec's own warnings (e.g. an unreadable cache)
    as one line on stderr and hands the others to ``show``."""

    def showwarning(message: Any, category: type[Warning], *rest: Any, **kwargs: Any) -> None:
        if issubclass(category, MixprecWarning):
            print(f"mixprec: warning: {message}", file=sys.stderr)
        else:
            show(message, category, *rest, **kwargs)

    return showwarning


def _close_scripts() -> None:
    """A command over a script removes the scratch folders of its runs when it ends."""
    if "mixprec.frameworks.script.workload" in sys.modules:
        from mixprec.frameworks.script.launch import stop_all
        from mixprec.frameworks.script.workload import close_all

        stop_all()
        close_all()


def list_models(pattern: str, out: Console) -> int:
    """``--list-models [PATTERN]``: the models loadable by name with this install."""
    from mixprec.report.console import models_report
    from mixprec.workload.models import list_models as available

    out.print(models_report(available(pattern or None), pattern or None))
    return 0


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """mixprec's own arguments, and the user's training command after the first ``--`` (None when
    there is no ``--``): ``mixprec tune --budget 60 -- python train.py --lr 3e-4``."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; errors become one line on stderr and an exit code (docs/cli.md)."""
    parser = build_parser()
    own, command = split_command(sys.argv[1:] if argv is None else argv)
    if command is None:
        forgotten = forgotten_separator(parser, own)
        if forgotten is not None:
            parser.error(forgotten)
    args = parser.parse_args(own)
    args.script = command
    args.argv = [*own, *(["--", *command] if command is not None else [])]  # what a result records
    if command is not None and args.command not in SCRIPT_COMMANDS:
        parser.error(
            f"`mixprec {args.command}` takes no training command after '--' "
            f"(the commands that run your script: {', '.join(SCRIPT_COMMANDS)})"
        )
    if args.command == "run" and command is None:
        parser.error(
            "`mixprec run` runs your training command: mixprec run --policy bf16-mixed -- python train.py"
        )
    # Piped output (CI logs, files) gets a wide fixed width instead of rich's 80 columns.
    stdout = Console()
    if not stdout.is_terminal:
        stdout = Console(width=140)
    stderr = Console(stderr=True)
    quiet_known_noise()
    try:
        if getattr(args, "list_models", None) is not None:
            return list_models(args.list_models, stdout)
        with warnings.catch_warnings(), _sigterm_raises():
            warnings.showwarning = _one_line_warnings(warnings.showwarning)
            prepared = check_outputs(args)
            try:
                with OutputLock(prepared.locks):
                    return int(args.run(args, stdout, stderr) or 0)
            finally:
                prepared.discard_empty_folders()  # a run that wrote nothing leaves no folder behind
                _close_scripts()
    except MixprecError as exc:
        if args.debug:
            raise
        print(f"mixprec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated:
        print("mixprec: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("mixprec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # argparse exits before this block; this is user code calling exit()
        if args.debug:
            raise
        print(
            f"mixprec: error: the workload called sys.exit({exc.code!r}) while mixprec ran it; a workload "
            "must not exit: put a script's own code under `if __name__ == '__main__':`.",
            file=sys.stderr,
        )
        return UsageError.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
