"""The user's training script as a source of training steps: ``mixprec tune|check|run -- python
train.py ...`` (:class:`ScriptFramework` over a :class:`ScriptWorkload`; :mod:`.agent` runs inside
the script's process)."""

from mixprec.frameworks.script.framework import ScriptFramework, run_line
from mixprec.frameworks.script.workload import ScriptFacts, ScriptWorkload

__all__ = ["ScriptFacts", "ScriptFramework", "ScriptWorkload", "run_line"]
