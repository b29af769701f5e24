"""Names of a package imported on first use (PEP 562): ``import mixprec`` stays light, so a training
script that mixprec's agent runs in pays for torch and the few modules it uses, not for all of them.

In the package's ``__init__``::

    __getattr__, __dir__ = lazy_names(__name__, {"Policy": "mixprec.policy.policy", ...})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: each name of ``names`` is
    taken from its module (``names[name]``) when first asked for, then kept on the package."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__
