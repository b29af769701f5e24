"""The user's training script as a source of training steps: ``mixprec tune|check|run -- python
train.py ...`` (:class:`ScriptFramework` over a :class:`ScriptWorkload`; :mod:`.agent` runs inside
the script's process, which imports only what it uses: the names below load on first use)."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.frameworks.script.framework import ScriptFramework, run_line
    from mixprec.frameworks.script.workload import ScriptFacts, ScriptWorkload

_LAZY = {
    "ScriptFramework": "mixprec.frameworks.script.framework",
    "run_line": "mixprec.frameworks.script.framework",
    "ScriptFacts": "mixprec.frameworks.script.workload",
    "ScriptWorkload": "mixprec.frameworks.script.workload",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec.frameworks.script' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["ScriptFacts", "ScriptFramework", "ScriptWorkload", "run_line"]
