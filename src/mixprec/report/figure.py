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


def figure_bytes(fig: Any, fmt: str, *, dpi: int) -> bytes:
    """``fig`` rendered in ``fmt`` (one of :data:`PLOT_FORMATS`), in memory; the figure is closed."""
    import matplotlib.pyplot as plt

    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt, dpi=dpi)
    finally:
        plt.close(fig)
    return buffer.getvalue()


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int, option: str = "--plot") -> Path:
    """Render ``fig`` in the format its suffix names and write it atomically; the figure is closed."""
    try:
        fmt = plot_format(path, option)
    except UsageError:
        figure_bytes(fig, "png", dpi=1)  # closes it
        raise
    return atomic_write_bytes(path, figure_bytes(fig, fmt, dpi=dpi), f"{option} file")
