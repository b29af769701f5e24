"""JSON output with the schema version and env block every mixprec file carries."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from mixprec.files import atomic_write_text
from mixprec.schema import SCHEMA_VERSION


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, (torch.device, Path)):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _finite(obj: Any) -> Any:
    """JSON has no inf/NaN: write them as strings so other tools can still parse the file."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def dumps(payload: dict[str, Any]) -> str:
    return json.dumps(_finite(json.loads(json.dumps(payload, default=_default))), indent=2)


def write_json(path: str | os.PathLike[str], kind: str, env: dict[str, Any], data: dict[str, Any]) -> Path:
    """Write ``{"schema_version", "kind", "env", **data}`` atomically (see :mod:`mixprec.files`)."""
    payload = {"schema_version": SCHEMA_VERSION, "kind": kind, "env": env, **data}
    return atomic_write_text(path, dumps(payload) + "\n", "--json file")
