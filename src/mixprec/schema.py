"""The version of mixprec's JSON files and the tolerant reading every ``from_dict`` shares.

Version 2 (mixprec 0.2) names each result's configuration as a ``candidate`` object and writes
``schema_version`` inside every result; version 1 files (mixprec 0.1) are still read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mixprec.errors import UsageError

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)


def check_version(data: Any, what: str) -> dict[str, Any]:
    """``data`` as a dict of a readable schema version, else a :class:`UsageError` naming the problem."""
    if not isinstance(data, dict):
        raise UsageError(f"{what} must be a JSON object, got {type(data).__name__}.")
    version = data.get("schema_version", SCHEMA_VERSION)
    if version not in READABLE_VERSIONS:
        raise UsageError(
            f"{what} has schema_version {version!r}; this mixprec reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}: re-create it with this version, or upgrade mixprec."
        )
    return data


_NON_FINITE = {
    "inf": math.inf,
    "infinity": math.inf,
    "-inf": -math.inf,
    "-infinity": -math.inf,
    "nan": math.nan,
}


def _revive(value: Any) -> Any:
    """Undo the JSON writer's encoding of inf/NaN as strings, inside lists and dicts too."""
    if isinstance(value, str) and value.lower() in _NON_FINITE:
        return _NON_FINITE[value.lower()]
    if isinstance(value, list):
        return [_revive(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_revive(v) for v in value)
    if isinstance(value, dict):
        return {k: _revive(v) for k, v in value.items()}
    return value


def known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``data`` that are fields of dataclass ``cls`` (newer files may carry more),
    with inf/NaN restored in the fields that hold numbers."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            out[f.name] = _revive(value) if "float" in str(f.type) else value
    return out
