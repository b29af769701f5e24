"""Command-line interface: the only layer that prints or exits.

Errors become one line on stderr and an exit code (2 usage, 3 unsupported, 4 numerics
failed); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from mixprec.cli import bench, check, demo, env, lint, tune
from mixprec.cli.quiet import quiet_known_noise
from mixprec.errors import MixprecError, UsageError

SUBCOMMANDS = (env, demo, bench, check, lint, tune)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's usage errors: one line, exit 2
        self.exit(2, f"mixprec: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from mixprec import __version__

    parser = _Parser(
        prog="mixprec", description="Mixed precision for PyTorch training: apply, measure, verify."
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


# Arguments naming files (or, for --report, a folder) that a command writes at its end.
_OUTPUT_ARGS = ("json", "csv", "markdown", "plot", "report")


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before measuring, not after: every output location must be creatable and writable."""
    for name in _OUTPUT_ARGS:
        value = getattr(args, name, None)
        if not value:
            continue
        path = Path(value)
        folder = path if name == "report" else path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"--{name} {value!r}: cannot create folder {str(folder)!r} ({exc.strerror})."
            ) from None
        if not os.access(folder, os.W_OK) or (path.exists() and path.is_dir() and name != "report"):
            raise UsageError(
                f"--{name} {value!r}: not a writable file location; pass a file path you can write."
            )


def list_models(pattern: str, out: Console) -> int:
    """``--list-models [PATTERN]``: the models loadable by name with this install."""
    from mixprec.report.console import models_report
    from mixprec.workload.models import list_models as available

    out.print(models_report(available(pattern or None), pattern or None))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Piped output (CI logs, files) gets a wide fixed width instead of rich's 80 columns.
    stdout = Console()
    if not stdout.is_terminal:
        stdout = Console(width=140)
    stderr = Console(stderr=True)
    quiet_known_noise()
    try:
        if getattr(args, "list_models", None) is not None:
            return list_models(args.list_models, stdout)
        check_outputs(args)
        return int(args.run(args, stdout, stderr) or 0)
    except MixprecError as exc:
        if args.debug:
            raise
        print(f"mixprec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("mixprec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
