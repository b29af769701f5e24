"""The user's training script as a source of training steps: ``mixprec tune|check|run -- python
train.py ...`` (:class:`ScriptFramework` over a :class:`ScriptWorkload`; :mod:`.agent` runs inside
the script's process, which imports only what it uses: the names below load on first use)."""

from typing import TYPE_CHECKING

from mixprec.lazy import lazy_names

if TYPE_CHECKING:
    from mixprec.frameworks.script.framework import ScriptFramework, run_line
    from mixprec.frameworks.script.workload import ScriptFacts, ScriptWorkload

_LAZY = {
    "ScriptFramework": "mixprec.frameworks.script.framework",
    "run_line": "mixprec.frameworks.script.framework",
    "ScriptFacts": "mixprec.frameworks.script.workload",
    "ScriptWorkload": "mixprec.frameworks.script.workload",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


__all__ = ["ScriptFacts", "ScriptFramework", "ScriptWorkload", "run_line"]
