"""``mixprec lint``: tensor-core-unfriendly shapes and precision mistakes, with stable rule ids.

``lint(workload, policy=...)`` returns the findings; ``run_lint`` returns them with their
context (suppressed unavoidable cases, notes), and ``measure_findings`` times the mechanical
fixes. The package itself is callable, so ``mixprec.lint(workload, policy="bf16-mixed")``
works while ``mixprec.lint.RULES`` and ``from mixprec.lint import Finding`` stay available.
"""

import sys
import types
from typing import Any

from mixprec.lint.measure import measure_findings
from mixprec.lint.rules import RULES, SEVERITIES, Finding, LintContext, MeasuredGain, Remedy, Rule
from mixprec.lint.runner import TARGETS, LintResult, lint, parse_rule_ids, run_lint
from mixprec.lint.trace import Trace, trace_workload


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> list[Finding]:
        return lint(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "RULES",
    "SEVERITIES",
    "TARGETS",
    "Finding",
    "LintContext",
    "LintResult",
    "MeasuredGain",
    "Remedy",
    "Rule",
    "Trace",
    "lint",
    "measure_findings",
    "parse_rule_ids",
    "run_lint",
    "trace_workload",
]
