"""One Finding vocabulary: lint's findings and the monitor's are specialisations of
mixprec.findings.Finding, answer the same four questions under the same names, and write the JSON
they always wrote."""

from __future__ import annotations

import json

from mixprec import findings
from mixprec.linting.model import Finding as LintAlias
from mixprec.linting.model import LintFinding
from mixprec.monitor import Finding as MonitorAlias
from mixprec.monitor import MonitorFinding

LINT_KEYS = {
    "rule", "name", "severity", "module", "message", "fix", "shape", "details", "flops_share",
    "suppressed", "mechanical_fix", "measured",
}  # fmt: skip
MONITOR_KEYS = {"step", "kind", "message", "module", "evidence", "action"}


def _lint() -> LintFinding:
    return LintFinding(
        "MP104", "linear-features", "warning", "fc", "in_features 100", "pad to 104", details={"n": 100}
    )


def _monitor() -> MonitorFinding:
    return MonitorFinding(139, "overflow", "the step overflowed", "head", {"scale": float("inf")})


def test_both_are_one_finding_with_the_same_four_answers():
    lint, monitor = _lint(), _monitor()
    assert isinstance(lint, findings.Finding) and isinstance(monitor, findings.Finding)
    assert (lint.kind, lint.module, lint.message, lint.evidence) == (
        "linear-features",
        "fc",
        "in_features 100",
        {"n": 100},
    )
    assert (monitor.kind, monitor.module, monitor.message) == ("overflow", "head", "the step overflowed")
    assert LintAlias is LintFinding and MonitorAlias is MonitorFinding  # the names their users import


def test_the_json_keys_are_the_ones_each_always_wrote():
    assert set(_lint().to_dict()) == LINT_KEYS
    assert set(_monitor().to_dict()) == MONITOR_KEYS
    assert json.loads(_monitor().to_json())["evidence"] == {"scale": "inf"}  # non-finite as a string


def test_a_finding_is_one_line_for_a_person():
    assert _lint().line() == "mixprec lint: fc: linear-features: in_features 100"
    assert _monitor().line() == "mixprec monitor: step 139: overflow [head]: the step overflowed"
