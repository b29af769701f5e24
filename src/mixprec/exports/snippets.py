"""Helper code that the exports paste into the user's script, kept here as real, linted, tested Python.

Every top-level function and class of this module is emitted verbatim (``inspect.getsource``) by
:func:`source`, together with the snippets it calls. Emitted code may use only ``torch`` and the
standard-library names in :data:`STDLIB`; :func:`stdlib_imports` gives the export their imports.
:mod:`mixprec.policy.policy` uses the same functions, so an export and ``Policy.prepare()`` convert
inputs, wrap fp32 islands and set the default dtype with one copy of the code.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

# What emitted code may use besides torch: module -> import line, name -> "from" import.
STDLIB = {"contextlib": "contextlib", "fnmatch": "fnmatch", "functools": "functools"}
STDLIB_NAMES = {"Callable": "collections.abc", "Iterator": "collections.abc"}


def cast_floating(value: object, dtype: torch.dtype) -> object:
    """Cast the floating-point tensors in value (nested lists, tuples, dicts) to dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def to_channels_last(value: object) -> object:
    """4-D floating-point tensors in value (nested lists, tuples, dicts) to channels_last."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 4 and value.is_floating_point():
            return value.contiguous(memory_format=torch.channels_last)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(to_channels_last(v) for v in value)
    if isinstance(value, dict):
        return {k: to_channels_last(v) for k, v in value.items()}
    return value


def cast_inputs(dtype: torch.dtype, keep: tuple[str, ...] = ()) -> Callable:
    """A forward pre-hook (register it with with_kwargs=True) that casts the module's floating-point
    inputs to dtype, positional and keyword alike, except the keyword arguments named in keep."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = {k: v if k in keep else cast_floating(v, dtype) for k, v in kwargs.items()}
        return cast_floating(args, dtype), kwargs

    return hook


def channels_last_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook (with_kwargs=True): 4-D floating-point inputs, positional and keyword, to
    channels_last."""
    return to_channels_last(args), to_channels_last(kwargs)


def fp32_islands(model: torch.nn.Module, patterns: list[str]) -> dict[str, torch.nn.Module]:
    """The modules of model whose names match a keep_fp32 glob pattern (as mixprec's keep_fp32)."""
    named = {name: module for name, module in model.named_modules() if name}
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in named):
            raise ValueError(f"keep_fp32 pattern {pattern!r} matches no module of {type(model).__name__}")
    return {name: m for name, m in named.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)}


def keep_in_fp32(
    module: torch.nn.Module, device_type: str, output_dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """Run module outside autocast with fp32 inputs; cast its outputs to output_dtype if given."""
    if getattr(module, "_fp32_island", False):
        return module
    forward = module.forward

    @functools.wraps(forward)
    def fp32_forward(*args: object, **kwargs: object) -> object:
        with torch.autocast(device_type, enabled=False):
            out = forward(*cast_floating(args, torch.float32), **cast_floating(kwargs, torch.float32))
        return out if output_dtype is None else cast_floating(out, output_dtype)

    module.forward = fp32_forward
    module._fp32_island = True
    return module


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make dtype the default dtype inside the block (tensors created without a dtype get it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def default_dtype_in_forward(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Run module's forward with dtype as the default dtype, restored afterwards (also on errors)."""
    saved = []

    def enter(mod: torch.nn.Module, args: tuple) -> None:
        saved.append(torch.get_default_dtype())
        torch.set_default_dtype(dtype)

    def leave(mod: torch.nn.Module, args: tuple, output: object) -> None:
        torch.set_default_dtype(saved.pop())

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    return module


class HalfGradScaler(torch.amp.GradScaler):
    """GradScaler that also unscales fp16 gradients (refused by default); fp16-true has only those."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # private GradScaler hook
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


_SNIPPETS: dict[str, object] = {
    obj.__name__: obj
    for obj in (
        cast_floating,
        to_channels_last,
        cast_inputs,
        channels_last_inputs,
        fp32_islands,
        keep_in_fp32,
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
