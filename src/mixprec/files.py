"""How mixprec writes files: never through a link or onto what is not a regular file, atomically
when it replaces one, and one run at a time per output.

The contract (docs/cli.md, "Files"):

- A path that exists must be a regular file. A symbolic link, a directory, a device (``/dev/null``)
  or a FIFO is refused with a :class:`~mixprec.errors.UsageError` before anything is written:
  writing through a link would change a file the user did not name, and renaming over a device
  node would replace the node itself.
- A file is replaced atomically: the text goes to a temporary file in the same folder, is flushed
  to disk, and is renamed over the target, so a reader never sees half a file and a crash leaves
  the old one. Appends (the row stream) open the file without following links.
- :class:`OutputLock` takes one lock per output stem (``out/r.json`` and ``out/r.jsonl`` share
  ``out/.r.lock``): a second run on the same outputs is refused instead of interleaving rows.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from mixprec.errors import CacheWarning, UsageError


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular_target(path: str | os.PathLike[str], what: str = "output") -> Path:
    """``path`` as a Path when it is absent or a regular file (not a link); else a UsageError."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # creating its folder will say what is wrong
        return path
    except OSError as exc:
        raise UsageError(f"{what} {str(path)!r}: cannot be inspected ({exc.strerror or exc}).") from None
    if stat.S_ISREG(mode):
        return path
    extra = ""
    if stat.S_ISLNK(mode):
        extra = f" (to {os.readlink(path)!r})"
    raise UsageError(
        f"{what} {str(path)!r} is {_kind(mode)}{extra}; mixprec writes only regular files and never "
        "through links or onto devices: pass the path of a regular file (or of one to create)."
    )


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, what: str = "output") -> Path:
    """Replace ``path`` with ``data`` atomically (temporary file in the same folder, fsync, rename).

    Refuses a ``path`` that is a link, a directory or a device (see the module docstring); an
    existing file keeps its permission bits. Failures raise :class:`UsageError` naming the path,
    and leave neither a temporary file nor a changed target behind.
    """
    path = check_regular_target(path, what)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"{what} {str(path)!r}: cannot create folder {str(path.parent)!r} ({exc.strerror or exc})."
        ) from None
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = None
    tmp = _temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if mode is not None:
                os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UsageError(f"cannot write {what} {str(path)!r}: {exc.strerror or exc}.") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str, what: str = "output") -> Path:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"), what)


def open_regular(path: str | os.PathLike[str], flags: int, what: str = "output") -> int:
    """A file descriptor of ``path`` opened with ``flags`` (plus O_NOFOLLOW, O_CLOEXEC, and O_CREAT
    when asked), checked to be a regular file; a UsageError naming the path otherwise."""
    path = check_regular_target(path, what)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(f"{what} {str(path)!r} is a symbolic link; pass the real path.") from None
        raise UsageError(f"cannot open {what} {str(path)!r}: {exc.strerror or exc}.") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        check_regular_target(path, what)  # raises with the kind of file it is
        raise UsageError(f"{what} {str(path)!r} is not a regular file.")
    return fd


def probe_folder(folder: str | os.PathLike[str], what: str) -> None:
    """Fail now, not after measuring, when no file can be created in ``folder`` (read-only,
    ``/proc``, no permission): create and remove a temporary file there."""
    folder = Path(folder)
    probe = folder / f".mixprec-probe-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise UsageError(
            f"{what}: cannot create files in {str(folder)!r} ({exc.strerror or exc}); "
            "pass a location you can write."
        ) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def lock_path(output: str | os.PathLike[str], is_dir: bool = False) -> Path:
    """The lock file of an output: ``.<stem>.lock`` beside a file, ``.mixprec.lock`` in a folder."""
    output = Path(output)
    if is_dir:
        return output / ".mixprec.lock"
    return output.parent / f".{output.stem}.lock"


class OutputLock:
    """Exclusive locks (``flock``) on the lock files of a run's outputs, held for the whole run.

    A second run that names an output whose stem is locked is refused with the other run's pid.
    The kernel drops a lock when its process dies (even on SIGKILL), so a stale lock file never
    blocks a later run; the files are removed on release.
    """

    def __init__(self, locks: Iterable[str | os.PathLike[str]], what: str = "output") -> None:
        self.paths = list(dict.fromkeys(Path(p) for p in locks))
        self.what = what
        self._held: list[tuple[Path, int]] = []

    def _acquire(self, path: Path) -> int:
        while True:
            fd = open_regular(path, os.O_RDWR | os.O_CREAT, "lock file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                stem = path.name.removeprefix(".").removesuffix(".lock")
                raise UsageError(
                    f"another mixprec run (pid {holder}) is writing the {self.what} {stem!r} in "
                    f"{str(path.parent)!r} (lock {str(path)!r}); wait for it to finish or pass other "
                    "output paths."
                ) from None
            # A releasing run unlinks the file it locked: make sure ours is still the one in place.
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
            os.close(fd)

    def __enter__(self) -> OutputLock:
        try:
            for path in self.paths:
                self._held.append((path, self._acquire(path)))
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        for path, fd in reversed(self._held):
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
        self._held.clear()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def read_json_cache(
    path: Path,
    what: str,
    version: int,
    section: str,
    *,
    version_key: str = "version",
    then: str = "",
) -> dict[str, Any]:
    """The ``section`` of the JSON cache at ``path`` (``{version_key: version, section: {...}}``), for
    the caller to check entry by entry. A missing file reads as empty; an unreadable one (a folder,
    binary, not JSON) or one of another version as empty with one :class:`CacheWarning` naming
    ``what`` it is and, when given, what happens ``then`` ("measuring again"). A cache is a saving,
    never a reason to fail."""
    after = f"; {then}." if then else "."
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        why = getattr(exc, "strerror", None) or type(exc).__name__
        warnings.warn(f"{what} {str(path)!r} is unreadable ({why}){after}", CacheWarning, 4)
        return {}
    found_version = data.get(version_key) if isinstance(data, dict) else None
    found = data.get(section) if isinstance(data, dict) and found_version == version else None
    if not isinstance(found, dict):
        warnings.warn(
            f"{what} {str(path)!r} is not a version-{version} file ({version_key} {found_version!r}){after}",
            CacheWarning,
            4,
        )
        return {}
    return found


def write_json_cache(
    path: Path, what: str, version: int, section: str, data: dict[str, Any], lost: str = ""
) -> None:
    """Replace the JSON cache at ``path`` with ``data`` in the layout :func:`read_json_cache` reads;
    one that cannot be written is a :class:`CacheWarning` saying what is ``lost`` (default: ``what``)
    and why: a cache is a saving, never a reason to fail."""
    text = json.dumps({"version": version, section: data}, indent=1, sort_keys=True)
    try:
        atomic_write_text(path, text, what)
    except UsageError as exc:
        warnings.warn(f"{lost or what} not kept: {exc}", CacheWarning, 3)
