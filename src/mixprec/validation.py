"""The argument checks every config shares (one function per kind of value), and the two things
every config does alike: take keyword fields (:func:`with_fields`) and record itself (:func:`to_dict`).

Each check returns the value (normalised where that is its job) or raises one
:class:`~mixprec.errors.UsageError` that repeats the name and the bad value and says what is
valid, the line the CLI prints. ``bool`` is refused where a number is asked for: ``True`` is an
``int`` in Python, and ``steps=True`` is always a mistake.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from mixprec.errors import UsageError, did_you_mean

C = TypeVar("C")
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


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


def require(name: str, value: Any, ok: bool, what: str) -> Any:
    """``value`` where ``ok`` holds, else "{name} must be {what}, got {value!r}." (a kind of value
    the checks above do not cover: a Candidate, a mapping, a fixed word)."""
    if not ok:
        raise UsageError(f"{name} must be {what}, got {value!r}.")
    return value


def byte_size(name: str, value: Any) -> int:
    """Bytes > 0 from a number of them or a size as users write it ('16GiB', '512MB', '2g'; binary
    units: a GB here is a GiB, as nvidia-smi and PyTorch's allocator count)."""
    size, text = 0, value.lower() if isinstance(value, str) else ""
    if _is_number(value) and math.isfinite(value):
        size = int(value)
    elif match := re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text):
        size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size <= 0:
        raise UsageError(
            f"{name} must be a number of bytes > 0 or a size such as '16GiB', '512MiB' or '24g' (binary "
            f"units: a GB is a GiB), got {value!r}; write it like {name}='16GiB'."
        )
    return size


def with_fields(
    config: C,
    changes: dict[str, Any],
    command: str,
    *,
    flat: Mapping[str, tuple[str, str]] | None = None,
    notes: Mapping[str, str] | None = None,
) -> C:
    """``dataclasses.replace(config, **changes)``, so the config checks itself again: how every
    facade (bench, check, tune, the Monitor) takes keyword fields. ``flat`` names a nested config's
    field by a keyword of its own (tune's ``{"check_steps": ("check", "steps")}``; a refused value is
    named as given). A name the config does not have is one UsageError naming it, why where
    ``notes`` says (a renamed argument) or else the closest valid name, and the valid ones."""
    flat, notes = flat or {}, notes or {}
    valid = [f.name for f in dataclasses.fields(config)] + list(flat)  # type: ignore[arg-type]
    for name in changes:
        if name not in valid:
            why = f" ({notes[name]})." if name in notes else f".{did_you_mean(name, valid)}"
            raise UsageError(f"{command}() has no setting {name!r}{why} Valid: {', '.join(valid)}.")
    own = {k: v for k, v in changes.items() if k not in flat}
    for outer in dict.fromkeys(outer for outer, _ in flat.values()):
        given = {flat[k][1]: k for k in changes if k in flat and flat[k][0] == outer}
        if not given:
            continue
        try:
            inner = own.get(outer, getattr(config, outer))
            own[outer] = dataclasses.replace(inner, **{n: changes[k] for n, k in given.items()})
        except UsageError as exc:  # "check_steps must be ...", not the nested "steps must be ..."
            field = next((n for n in given if str(exc).startswith(f"{n} ")), None)
            if field is None:
                raise
            raise UsageError(given[field] + str(exc)[len(field) :]) from None
    return dataclasses.replace(config, **own)  # type: ignore[type-var]


def to_dict(config: Any, **derived: Any) -> dict[str, Any]:
    """A config's fields as JSON values, what a result records of it (``derived`` replaces a field's
    value first): a nested config as its own ``to_dict``, a Candidate by its label, other dataclasses
    (Thresholds) as dicts, an enum by its value, a tuple as a list, a mapping with string keys, a path
    or a device as its string."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {name: _json(value) for name, value in {**values, **derived}.items()}


def _json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_json(v) for v in value]
    if hasattr(value, "label"):  # a Candidate
        return value.label
    if dataclasses.is_dataclass(value):
        return value.to_dict() if hasattr(value, "to_dict") else dataclasses.asdict(value)  # type: ignore[arg-type]
    return str(value)
