"""The argument checks every config shares: one function per kind of value.

Each returns the value (normalised where that is its job) or raises one
:class:`~mixprec.errors.UsageError` that repeats the name and the bad value and says what is
valid, the line the CLI prints. ``bool`` is refused where a number is asked for: ``True`` is an
``int`` in Python, and ``steps=True`` is always a mistake.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable
from typing import Any, TypeVar

from mixprec.errors import UsageError

C = TypeVar("C")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(name: str, value: Any, *, zero_ok: bool = False, minimum: int | None = None) -> int:
    """An integer >= 1 (>= 0 with ``zero_ok``, >= ``minimum`` where one is given)."""
    low = minimum if minimum is not None else (0 if zero_ok else 1)
    if not _is_int(value) or value < low:
        raise UsageError(f"{name} must be an integer >= {low}, got {value!r}.")
    return int(value)


def optional_positive_int(name: str, value: Any) -> int | None:
    """None, or an integer >= 1."""
    return None if value is None else positive_int(name, value)


def seconds(name: str, value: Any, *, zero_ok: bool = True) -> float:
    """A finite number of seconds, >= 0 (> 0 without ``zero_ok``)."""
    if not _is_number(value) or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise UsageError(f"{name} must be a finite number of seconds {bound}, got {value!r}.")
    return float(value)


def number_above(name: str, value: Any, bound: float) -> float:
    """A finite number strictly above ``bound``."""
    if not _is_number(value) or not math.isfinite(value) or value <= bound:
        raise UsageError(f"{name} must be a number > {bound:g}, got {value!r}.")
    return float(value)


def fraction(name: str, value: Any) -> float:
    """A number in [0, 1)."""
    if not _is_number(value) or not 0 <= value < 1:
        raise UsageError(f"{name} must be a number in [0, 1), got {value!r}.")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    """True or False (not a truthy string: 'false' would be True)."""
    if not isinstance(value, bool):
        raise UsageError(f"{name} must be True or False, got {value!r}.")
    return value


def one_of(name: str, value: Any, valid: Iterable[Any]) -> Any:
    """One of ``valid``; the error lists them."""
    options = list(valid)
    if value not in options:
        raise UsageError(f"Invalid {name} {value!r}; valid: {', '.join(map(str, options))}.")
    return value


def with_fields(config: C, changes: dict[str, Any], command: str) -> C:
    """``dataclasses.replace(config, **changes)`` (so the config checks itself again), where a name
    the config does not have is one UsageError naming it, the closest valid one and the rest."""
    valid = [f.name for f in dataclasses.fields(config)]  # type: ignore[arg-type]
    for name in changes:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"{command}() has no setting {name!r}.{hint} Valid: {', '.join(valid)}.")
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]
