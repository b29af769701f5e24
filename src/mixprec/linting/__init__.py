"""Lint: tensor-core-unfriendly shapes and precision mistakes, with stable rule ids.

:func:`lint` returns the findings; :func:`run_lint` returns them with their context (suppressed
unavoidable cases, notes). Timing the mechanical fixes (``lint --measure``) is a bench job:
:mod:`mixprec.measure.lint_gains`, whose ``lint`` (``mixprec.lint``) adds ``measure=True``.
"""

from mixprec.linting.context import LintContext
from mixprec.linting.model import SEVERITIES, Finding, LintResult, MeasuredGain, Remedy, Rule
from mixprec.linting.rules import RULES
from mixprec.linting.runner import TARGETS, lint, parse_rule_ids, run_lint
from mixprec.linting.trace import Trace, trace_workload

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
    "parse_rule_ids",
    "run_lint",
    "trace_workload",
]
