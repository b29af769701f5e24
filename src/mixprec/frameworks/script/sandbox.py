"""A measured run's working folder: the user's folder as the script reads it, never as it writes it.

``mixprec tune|check|bench -- python train.py`` runs the script many times, several at once (the
strict-fp32 baseline beside a candidate). None of those runs may write the user's files: a checkpoint
``ckpt.pt`` saved by a measured run would replace the user's, and two runs would write one file at
once. So each run starts in a folder of its own (:func:`mirror`), which holds a symbolic link to every
entry of the user's folder: the script's relative paths resolve as they would there (its data, its
configs, its tokenizer, for Python and C readers alike). In the script's process, every write that
would land in the user's folder (through a mirrored link, or an absolute path into it, such as
``Path(__file__).resolve().parent / "ckpt.pt"``) lands in the run's folder instead (:func:`install`):
a link is replaced by a real file (copied first where the file is appended to) and a linked folder by
a real folder of links, before the write. Python's ``open``, ``os.open``, ``torch.save``, folder
creation, removal and renaming are covered; a C library that writes through an existing link itself
(not through Python) is not.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def mirror(home: Path, folder: Path) -> Path:
    """``folder`` (made now) with a link to each entry of ``home``: the run's working folder."""
    folder.mkdir(parents=True)
    with os.scandir(home) as entries:
        for entry in entries:
            os.symlink(entry.path, folder / entry.name)
    return folder


class Sandbox:
    """Where the script's writes go: ``root`` (the run's folder) for whatever would land in ``home``."""

    def __init__(self, home: str, root: str, own: str | None = None) -> None:
        """``own``: mixprec's scratch folder, which holds ``root`` and the records the parent reads;
        left alone where it lies in ``home`` (a script run from /tmp, whose tune found no trace)."""
        self.home = os.path.realpath(home)
        self.root = os.path.realpath(root)
        self.own = os.path.realpath(own) if own is not None else None
        if self.own is not None and (self.home + os.sep).startswith(self.own + os.sep):
            self.own = None  # (the user's folder inside mixprec's: nothing of it may be let through)
        # the originals, for the sandbox's own file operations
        self._unlink, self._mkdir, self._symlink = os.unlink, os.mkdir, os.symlink

    def _inside(self, path: str) -> str | None:
        """``path`` relative to the run's folder when it lies in it or in the user's folder."""
        full = os.path.abspath(path)
        # the run's folder first (it may lie inside the user's), then mixprec's own, left alone
        for base in (self.root, self.own, self.home):
            if base is not None and (full == base or full.startswith(base + os.sep)):
                return None if base == self.own else os.path.relpath(full, base)
        return None

    def reading(self, path: Any) -> Any:
        """Where a read of ``path`` goes: an absolute path into the user's folder reads the run's copy
        (what the run wrote there, else the link to the user's file)."""
        if not isinstance(path, (str, os.PathLike)):
            return path
        text = os.fspath(path)
        if not isinstance(text, str) or not os.path.isabs(text):
            return path
        full = os.path.abspath(text)
        if self.own is not None and full.startswith(self.own + os.sep):
            return path  # mixprec's own records
        if full.startswith(self.home + os.sep) and not full.startswith(self.root + os.sep):
            mapped = os.path.join(self.root, os.path.relpath(full, self.home))
            if os.path.lexists(mapped):
                return mapped
        return path

    def writing(self, path: Any, *, keep: bool = False, folder: bool = False, entry: bool = True) -> Any:
        """Where a write of ``path`` goes, made safe: the folders on the way turned from links into
        real folders of links, and the entry itself, where it is a link, replaced by a real copy
        (``keep``: its content copied, for an append or an update; ``folder``: a folder of links;
        ``entry=False``: the entry is left as it is, a link removed or renamed being only a link)."""
        if not isinstance(path, (str, os.PathLike)):
            return path  # a file descriptor, a file object: already open
        text = os.fspath(path)
        if not isinstance(text, str):
            return path
        rel = self._inside(text)
        if rel is None:
            return path  # not the user's folder: the script's own business (/tmp, a cache)
        target = self.root if rel == "." else os.path.join(self.root, rel)
        if rel == ".":
            return target
        parts = rel.split(os.sep)
        here = self.root
        for part in parts[:-1]:
            here = os.path.join(here, part)
            if os.path.islink(here):
                self._own_folder(here)
            elif not os.path.isdir(here):
                return target  # a folder not there yet: the write creates it in the run's folder
        if entry and os.path.islink(target):
            if folder or os.path.isdir(target):
                self._own_folder(target)
            elif keep:
                source = os.path.realpath(target)
                self._unlink(target)
                shutil.copyfile(source, target)
            else:
                self._unlink(target)
        return target

    def _own_folder(self, link: str) -> None:
        """Replace ``link`` (to a folder) by a real folder holding a link to each of its entries."""
        source = os.path.realpath(link)
        self._unlink(link)
        self._mkdir(link)
        if os.path.isdir(source):
            with os.scandir(source) as entries:
                for entry in entries:
                    self._symlink(entry.path, os.path.join(link, entry.name))


def _relative_to_fd(kw: dict[str, Any]) -> bool:
    """A call whose path is relative to an open folder's descriptor (``shutil.rmtree`` walks so),
    not to the working folder: that folder was reached, and made safe, by the call that opened it."""
    return any(kw.get(k) is not None for k in ("dir_fd", "src_dir_fd", "dst_dir_fd"))


def install(home: str, root: str, own: str | None = None) -> Callable[[], None]:
    """Redirect the writes of this process that would land in ``home`` to ``root`` (never those into
    mixprec's ``own`` scratch folder); returns what puts every patched function back."""
    box = Sandbox(home, root, own)
    undo: list[Callable[[], None]] = []

    def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        undo.append(lambda: setattr(owner, name, original))

    def opening(original: Any) -> Any:
        def open_(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
            if any(c in mode for c in "wax+"):
                file = box.writing(file, keep=any(c in mode for c in "a+") and "w" not in mode)
            else:
                file = box.reading(file)
            return original(file, mode, *args, **kw)

        return open_

    def os_opening(original: Any) -> Any:
        def open_(path: Any, flags: int, *args: Any, **kw: Any) -> Any:
            if _relative_to_fd(kw):
                return original(path, flags, *args, **kw)
            if flags & _WRITE_FLAGS:
                path = box.writing(path, keep=not flags & os.O_TRUNC)
            else:
                path = box.reading(path)
            return original(path, flags, *args, **kw)

        return open_

    def one_path(**how: bool) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def call(path: Any, *args: Any, **kw: Any) -> Any:
                if _relative_to_fd(kw):
                    return original(path, *args, **kw)
                return original(box.writing(path, **how), *args, **kw)

            return call

        return make

    def two_paths(original: Any) -> Any:
        def call(src: Any, dst: Any, *args: Any, **kw: Any) -> Any:
            if _relative_to_fd(kw):
                return original(src, dst, *args, **kw)
            return original(box.writing(src, entry=False), box.writing(dst), *args, **kw)

        return call

    def stat(original: Any) -> Any:
        def call(path: Any, *args: Any, **kw: Any) -> Any:
            if _relative_to_fd(kw):
                return original(path, *args, **kw)
            return original(box.reading(path), *args, **kw)

        return call

    def saving(original: Any) -> Any:
        def save(obj: Any, f: Any, *args: Any, **kw: Any) -> Any:
            return original(obj, box.writing(f), *args, **kw)

        return save

    patch(builtins, "open", opening)
    patch(io, "open", opening)  # (the same function as open, under the name pathlib calls)
    patch(os, "open", os_opening)
    patch(os, "mkdir", one_path(folder=True))
    patch(os, "rmdir", one_path(folder=True))
    for name in ("remove", "unlink"):
        patch(os, name, one_path(entry=False))
    patch(os, "truncate", one_path(keep=True))
    for name in ("rename", "replace"):
        patch(os, name, two_paths)
    patch(os, "stat", stat)
    patch(shutil, "rmtree", one_path(folder=True))
    import torch

    patch(torch, "save", saving)
    patch(torch.serialization, "save", lambda original: torch.save)

    def restore() -> None:
        while undo:
            undo.pop()()

    return restore
