"""A command's output paths, checked before anything is measured, and locked while it runs.

Every file a command will write (``--json``, its ``.jsonl`` row stream, ``--csv``, ``--markdown``,
``--plot``, the files of a ``--report`` / ``--out`` folder) is known from its arguments. Before the
command runs: each must be a regular file or absent (:mod:`mixprec.files`), its folder creatable
and writable (a probe file is created there and removed), a plot's suffix a format mixprec
writes, and no two outputs, nor an output and an input, the same file. Then one lock per output
stem is held until the command ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from mixprec.errors import UsageError
from mixprec.files import check_regular_target, lock_path, probe_folder
from mixprec.report.figure import plot_format
from mixprec.report.html import REPORT_FILES

# Options naming one output file each, and the folder options of report-writing commands.
FILE_OPTIONS = ("json", "csv", "markdown", "plot")
FOLDER_OPTIONS = {"report": "--report", "out": "--out"}


@dataclass(frozen=True)
class Output:
    option: str  # how the user named it, e.g. "--json" or "--json's row stream"
    path: Path
    folder: bool = False


def planned_outputs(args: argparse.Namespace) -> list[Output]:
    """Every output the parsed command line names, derived ones (the row stream) included."""
    outputs = []
    for name in FILE_OPTIONS:
        value = getattr(args, name, None)
        if value:
            outputs.append(Output(f"--{name}", Path(value)))
    if getattr(args, "command", None) == "bench" and getattr(args, "json", None):
        outputs.append(Output("--json's row stream", Path(args.json).with_suffix(".jsonl")))
    for name, option in FOLDER_OPTIONS.items():
        value = getattr(args, name, None)
        if value and isinstance(value, str):
            outputs.append(Output(option, Path(value), folder=True))
    return outputs


def planned_inputs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """Files a command reads that it must not overwrite."""
    results = getattr(args, "results", None)
    return [("results file", Path(results))] if results else []


def _identity(path: Path) -> str:
    """The same string for two spellings of one file (relative/absolute, a linked folder)."""
    return os.path.normcase(os.path.join(os.path.realpath(path.parent), path.name))


@dataclass
class Prepared:
    """What :func:`check_outputs` set up: the lock files to hold, and the folders it created
    (shallowest first), removed again when the command leaves them empty."""

    locks: list[Path] = field(default_factory=list)
    created: list[Path] = field(default_factory=list)

    def discard_empty_folders(self) -> None:
        for folder in reversed(self.created):
            with contextlib.suppress(OSError):  # not empty: the command wrote there
                folder.rmdir()


def _folder_problem(option: str, folder: Path) -> None:
    """A UsageError when ``folder`` or one of its parents is a file (checked before creating anything)."""
    for part in (folder, *folder.parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                raise UsageError(
                    f"{option}: cannot create folder {str(folder)!r}: {str(part)!r} is a file; "
                    "pass a path in a folder."
                )
            return


def _prepare_folder(option: str, folder: Path, prepared: Prepared) -> None:
    """Create ``folder`` when missing and make sure files can be created in it."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"{option}: cannot create folder {str(folder)!r} ({exc.strerror or exc}); "
            "pass a path you can write."
        ) from None
    prepared.created += [p for p in missing if p not in prepared.created]
    probe_folder(folder, option)


def check_outputs(args: argparse.Namespace) -> Prepared:
    """Validate every output of ``args`` (see the module docstring), then create the folders they
    need; return the lock files to hold and the folders created. Nothing is created when a check
    fails."""
    files: list[tuple[str, Path]] = []
    folders: list[tuple[str, Path]] = []
    locks: list[Path] = []
    for out in planned_outputs(args):
        if out.folder:
            if out.path.exists() and not out.path.is_dir():
                raise UsageError(
                    f"{out.option} {str(out.path)!r} is a file, not a folder; pass a folder for the report."
                )
            _folder_problem(out.option, out.path)
            folders.append((out.option, out.path))
            names = getattr(args, "out_files", None) or REPORT_FILES  # a command's own, else a report's
            files += [(f"{out.option} {str(out.path)!r}", out.path / name) for name in names]
            locks.append(lock_path(out.path, is_dir=True))
            continue
        check_regular_target(out.path, out.option)
        if out.option == "--plot":
            plot_format(out.path)
        label = f"{out.option} {str(out.path)!r}"
        _folder_problem(label, out.path.parent)
        folders.append((label, out.path.parent))
        files.append((out.option, out.path))
        locks.append(lock_path(out.path))
    for option, path in files:
        check_regular_target(path, option)
    seen: dict[str, str] = {}
    for option, path in [*planned_inputs(args), *files]:
        key = _identity(path)
        if key in seen:
            hint = (
                f" (--json names the summary; its rows stream to the .jsonl beside it: pass e.g. "
                f"{path.with_suffix('.json').name!r})"
                if "row stream" in option
                else ""
            )
            raise UsageError(
                f"{seen[key]} and {option} are the same file {str(path)!r}: one would overwrite the "
                f"other; pass different paths{hint}."
            )
        seen[key] = option
    prepared = Prepared(locks=locks)
    try:
        for label, folder in folders:
            _prepare_folder(label, folder, prepared)
    except BaseException:
        prepared.discard_empty_folders()
        raise
    return prepared
