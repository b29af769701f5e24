"""Emit the helper code of :mod:`mixprec.policy.hooks` into exported scripts.

Every function and class listed in ``_SNIPPETS`` is emitted verbatim (``inspect.getsource``) by
:func:`source`, together with the snippets it calls; :func:`stdlib_imports` gives the export the
imports they need. ``Policy.prepare()`` runs the very same functions.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from mixprec.policy.hooks import (
    STDLIB,
    STDLIB_NAMES,
    CastInputs,
    Fp32Island,
    HalfGradScaler,
    cast_floating,
    cast_inputs,
    channels_last_inputs,
    default_dtype,
    default_dtype_in_forward,
    fp32_islands,
    keep_batch_norm_fp32,
    keep_in_fp32,
    matches_any,
    refuse_split_ties,
    to_channels_last,
)

_SNIPPETS: dict[str, object] = {
    obj.__name__: obj
    for obj in (
        cast_floating,
        to_channels_last,
        CastInputs,
        cast_inputs,
        channels_last_inputs,
        fp32_islands,
        matches_any,
        Fp32Island,
        keep_in_fp32,
        keep_batch_norm_fp32,
        refuse_split_ties,
        default_dtype,
        default_dtype_in_forward,
        HalfGradScaler,
    )
}


def _depends_on(name: str) -> list[str]:
    text = inspect.getsource(_SNIPPETS[name])  # type: ignore[arg-type]
    return [other for other in _SNIPPETS if other != name and re.search(rf"\b{other}\(", text)]


def needed(names: list[str]) -> list[str]:
    """``names`` with the snippets they call, each once, callees first, in this module's order."""
    wanted: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name not in _SNIPPETS:
            raise KeyError(f"no snippet named {name!r}; known: {', '.join(_SNIPPETS)}")
        if name not in wanted:
            wanted.add(name)
            stack += _depends_on(name)
    return [n for n in _SNIPPETS if n in wanted]


def source(names: list[str]) -> list[str]:
    """The source blocks of ``names`` and their dependencies (see :func:`needed`), in emission order."""
    return [inspect.getsource(_SNIPPETS[n]).rstrip("\n") for n in needed(names)]  # type: ignore[arg-type]


def stdlib_imports(blocks: list[str]) -> list[str]:
    """The standard-library import lines that emitted ``blocks`` need, in isort order."""
    modules = [f"import {m}" for m in STDLIB if any(re.search(rf"\b{m}\.", b) for b in blocks)]
    names: dict[str, list[str]] = {}
    for name, module in STDLIB_NAMES.items():
        if any(re.search(rf"\b{name}\b", b) for b in blocks):
            names.setdefault(module, []).append(name)
    froms = [f"from {module} import {', '.join(sorted(n))}" for module, n in names.items()]
    return sorted(modules) + sorted(froms)


def source_in_file(path: str, name: str) -> str:
    """The source of top-level function or class ``name`` in the Python file at ``path``, decorators
    included, read from the text: for snippet modules that import an optional framework."""
    text = Path(path).read_text(encoding="utf-8")
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return "\n".join(text.splitlines()[first - 1 : node.end_lineno])
    raise KeyError(f"{path} defines no top-level {name!r}")
