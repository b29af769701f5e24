"""The text helpers every export writes with: Python literals, ``#`` comments and bullets wrapped at
:data:`WIDTH`, calls laid out as ruff format lays them out, file sections, imports and the pasted
helper snippets. Pure string work: nothing here knows a policy."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence

import torch

from mixprec.exports import snippets

SECTION_PREFIX = "# --- "
SECTION_SUFFIX = " ---"
WIDTH = 100  # comment lines wrap here; code stays within ruff's 110
DTYPE_CODE = {
    torch.bfloat16: "torch.bfloat16",
    torch.float16: "torch.float16",
    torch.float32: "torch.float32",
}
DTYPE_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def py(value: object) -> str:
    """A Python literal for ``value``, with double-quoted strings as ruff format writes them."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(py(v) for v in value) + "]"
    return repr(value)


def comment(text: str, indent: int = 0, width: int = WIDTH) -> list[str]:
    """``text`` as ``# `` comment lines, wrapped at ``width`` columns (indent included)."""
    pad = " " * indent + "# "
    return textwrap.wrap(text, width=width, initial_indent=pad, subsequent_indent=pad, break_on_hyphens=False)


def bullets(items: list[str]) -> list[str]:
    """``items`` as ``#   - `` comment bullets, continuation lines indented under the text."""
    out: list[str] = []
    for item in items:
        out += textwrap.wrap(
            item, width=WIDTH, initial_indent="#   - ", subsequent_indent="#     ", break_on_hyphens=False
        )
    return out


def section(name: str) -> str:
    """The ``# --- <file name> ---`` line that starts a file in a multi-file export."""
    return f"{SECTION_PREFIX}{name}{SECTION_SUFFIX}"


def call_lines(head: str, args: list[str], width: int = 110) -> list[str]:
    """``head(args...)`` laid out as ruff format does: one line if it fits, else the arguments on one
    indented line, else one argument per line with a trailing comma."""
    flat = f"{head}({', '.join(args)})"
    if len(flat) <= width:
        return [flat]
    inner = "    " + ", ".join(args)
    if len(inner) <= width:
        return [f"{head}(", inner, ")"]
    return [f"{head}(", *(f"    {a}," for a in args), ")"]


def indent(lines: list[str], spaces: int) -> list[str]:
    return [" " * spaces + line if line else line for line in lines]


def join_lines(lines: list[str]) -> str:
    """Join lines; at most two blank lines in a row (PEP 8 around definitions), none at the end."""
    out: list[str] = []
    for line in lines:
        if line == "" and out[-2:] == ["", ""]:
            continue
        out.append(line)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def imports(*third_party: str, helpers: Sequence[str] = ()) -> list[str]:
    """Import lines in isort order: the standard library the ``helpers`` blocks need, a blank line,
    the third-party packages."""
    std = snippets.stdlib_imports(list(helpers))
    third = sorted(third_party, key=lambda s: (s.startswith("from "), s.split()[1].lower()))
    return [*std, *([""] if std and third else []), *third]


def preamble(device_type: str, *third_party: str, helpers: Sequence[str] = ()) -> list[str]:
    """A training script's :func:`imports`, then ``device_type`` (what its autocast and GradScaler
    lines name)."""
    return [*imports(*third_party, helpers=helpers), "", f"device_type = {py(device_type)}", ""]


def helpers(names: list[str]) -> list[str]:
    """The source blocks of the named snippets (and what they call)."""
    return snippets.source(names)


def helper_lines(blocks: list[str]) -> list[str]:
    """Helper blocks with two blank lines around each (PEP 8), or one blank line when there are none."""
    lines: list[str] = []
    for block in blocks:
        lines += ["", "", *block.splitlines()]
    return [*lines, "", ""] if lines else [""]
