"""Saving a matplotlib figure: the formats mixprec writes, and the write itself through
:mod:`mixprec.files` (atomic, never through a link)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from mixprec.errors import UsageError
from mixprec.files import atomic_write_bytes

# What a plot's file name may end in; the suffix picks the format.
PLOT_FORMATS = ("png", "svg", "pdf")


def plot_format(path: str | os.PathLike[str], option: str = "--plot") -> str:
    """The format of a plot file from its suffix; a UsageError naming the valid ones otherwise."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        shown = f"'.{suffix}'" if suffix else "no suffix"
        raise UsageError(
            f"{option} {str(path)!r} has {shown}; a plot is written as "
            f"{', '.join('.' + f for f in PLOT_FORMATS)}: pass e.g. {Path(path).stem or 'plot'}.png."
        )
    return suffix


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int, option: str = "--plot") -> Path:
    """Render ``fig`` in the format its suffix names, write it atomically and close it."""
    import matplotlib.pyplot as plt

    try:
        fmt = plot_format(path, option)
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt, dpi=dpi)
    finally:
        plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue(), f"{option} file")
