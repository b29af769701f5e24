"""What lint produces: severities, a :class:`Finding` with its :class:`Remedy` and
:class:`MeasuredGain`, the :class:`Rule` that makes findings, and a run's :class:`LintResult`.

Nothing here runs a rule or traces a model: the rules (:mod:`mixprec.linting.rules`), the
runner and ``--measure`` all build on these types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mixprec import findings
from mixprec.linting.context import LintContext
from mixprec.linting.trace import Trace
from mixprec.policy import Policy

SEVERITIES: tuple[str, ...] = ("info", "warning", "error")
SEVERITY_RANK = {name: i for i, name in enumerate(SEVERITIES)}


@dataclass(frozen=True)
class Remedy:
    """A mechanical fix that --measure can build and time.

    ``kind`` 'pad': zero-pad ``module``'s weight to ``in_to`` inputs and/or ``out_to``
    outputs, pad its input with zeros and slice its output back (the original outputs are
    unchanged). ``kind`` 'layout': run the model with ``channels_last`` on or off.

    Attributes:
        kind: 'pad' or 'layout'.
        module: the qualified name of the layer to pad ('pad' only).
        in_to: pad the layer's inputs (features or channels) to this many.
        out_to: pad the layer's outputs (features or channels) to this many.
        channels_last: run the model channels_last or not ('layout' only).
    """

    kind: str
    module: str | None = None
    in_to: int | None = None
    out_to: int | None = None
    channels_last: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, for JSON."""
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class MeasuredGain:
    """Before/after timings of a mechanical fix (median milliseconds, forward + backward).

    Attributes:
        layer_before_ms: the affected layer(s) as they are.
        layer_after_ms: the affected layer(s) with the fix.
        step_before_ms: the whole training step as it is.
        step_after_ms: the whole training step with the fix.
        layers: the layers timed for the layer figures.
        device: the device the timings ran on.
        note: why a figure is missing, if one is.
    """

    layer_before_ms: float | None = None
    layer_after_ms: float | None = None
    step_before_ms: float | None = None
    step_after_ms: float | None = None
    layers: tuple[str, ...] = ()
    device: str = ""
    note: str = ""

    @staticmethod
    def _gain(before: float | None, after: float | None) -> float | None:
        if before is None or after is None or before <= 0:
            return None
        return (before - after) / before * 100.0

    @property
    def layer_gain_pct(self) -> float | None:
        """How much faster the layer(s) got, in percent."""
        return self._gain(self.layer_before_ms, self.layer_after_ms)

    @property
    def step_gain_pct(self) -> float | None:
        """How much faster the training step got, in percent."""
        return self._gain(self.step_before_ms, self.step_after_ms)

    @property
    def gain_pct(self) -> float | None:
        """The step's gain when the step was timed, else the layer's: positive means faster."""
        step = self.step_gain_pct
        return step if step is not None else self.layer_gain_pct

    def to_dict(self) -> dict[str, Any]:
        """The timings and the gains derived from them, for JSON."""
        return {
            "layer_before_ms": self.layer_before_ms,
            "layer_after_ms": self.layer_after_ms,
            "layer_gain_pct": self.layer_gain_pct,
            "step_before_ms": self.step_before_ms,
            "step_after_ms": self.step_after_ms,
            "step_gain_pct": self.step_gain_pct,
            "gain_pct": self.gain_pct,
            "layers": list(self.layers),
            "device": self.device,
            "note": self.note,
        }


@dataclass
class LintFinding(findings.Finding):
    """One problem at one place, found before the model runs: mixprec's :class:`~mixprec.findings.Finding`
    with its rule (``kind`` is the rule's ``name``, ``evidence`` its ``details``) and its fix.

    Attributes:
        rule: the rule's id, e.g. 'MP101'.
        name: the rule's name, e.g. 'conv-channels'.
        severity: one of :data:`SEVERITIES`.
        module: a qualified module name, '' for the model's own forward, or None when the
            finding is about the whole model/optimizer/policy.
        message: what is wrong; the same text for the same problem in different layers.
        fix: a concrete change.
        shape: the layer and the shapes it ran with.
        details: the figures behind the finding, for JSON.
        flops_share: share of the model's matmul/conv FLOPs (forward).
        suppressed: why an unavoidable case is not reported; None for an active finding.
        remedy: set when --measure can build the fix.
        measured: what --measure timed.
        order: position in the forward pass, for a stable order.
    """

    rule: str
    name: str
    severity: str
    module: str | None
    message: str
    fix: str
    shape: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    flops_share: float | None = None
    suppressed: str | None = None
    remedy: Remedy | None = None
    measured: MeasuredGain | None = None
    order: int = 0

    source = "lint"

    @property
    def kind(self) -> str:
        """The rule's name: lint's kind of finding."""
        return self.name

    @property
    def evidence(self) -> dict[str, Any]:
        """The figures behind the finding (``details``)."""
        return self.details

    @property
    def where(self) -> str:
        """The module's name, '(model forward)', or '(scope)' for model-wide findings."""
        if self.module is None:
            return f"({self.details.get('scope', 'model')})"
        return self.module or "(model forward)"

    @property
    def mechanical(self) -> bool:
        """--measure can build and time the fix."""
        return self.remedy is not None

    def to_dict(self) -> dict[str, Any]:
        """The finding for JSON."""
        return {
            "rule": self.rule,
            "name": self.name,
            "severity": self.severity,
            "module": self.module,
            "message": self.message,
            "fix": self.fix,
            "shape": self.shape,
            "details": self.details,
            "flops_share": self.flops_share,
            "suppressed": self.suppressed,
            "mechanical_fix": self.remedy.to_dict() if self.remedy else None,
            "measured": self.measured.to_dict() if self.measured else None,
        }


Finding = LintFinding  # the name the rules and lint's users import

Check = Callable[[LintContext], Iterable[Finding]]


@dataclass(frozen=True)
class Rule:
    """A lint rule: a stable id (like a ruff code), a severity, a rationale, a source and a check.

    Attributes:
        id: the stable id, e.g. 'MP101'.
        name: a short kebab-case name, e.g. 'conv-channels'.
        severity: the most severe level this rule reports.
        summary: one line for the rule list.
        rationale: why it matters, and when it reports at which severity.
        source: where the advice comes from.
        check: reads a :class:`LintContext` and yields findings; never prints, never changes the model.
        tensor_core: judged for NVIDIA tensor cores: info on a CPU target.
        mechanical: --measure can build and time the fix.
    """

    id: str
    name: str
    severity: str
    summary: str
    rationale: str
    source: str
    check: Check = field(repr=False, compare=False)
    tensor_core: bool = False
    mechanical: bool = False

    def finding(self, severity: str, module: str | None, message: str, fix: str, **kw: Any) -> Finding:
        """A :class:`Finding` of this rule; ``kw`` sets the other fields."""
        return Finding(self.id, self.name, severity, module, message, fix, **kw)

    def to_dict(self) -> dict[str, Any]:
        """The rule for JSON and the rule list (without its check)."""
        return {k: v for k, v in vars(self).items() if k != "check"}


def define_rule(
    registry: dict[str, Rule],
    id: str,
    name: str,
    severity: str,
    *,
    summary: str,
    rationale: str,
    source: str,
    tensor_core: bool = False,
    mechanical: bool = False,
) -> Callable[[Check], Check]:
    """Decorator: register the decorated check in ``registry`` as the :class:`Rule` ``id``."""

    def register(check: Check) -> Check:
        if id in registry:
            raise ValueError(f"rule {id} is defined twice")
        registry[id] = Rule(id, name, severity, summary, rationale, source, check, tensor_core, mechanical)
        return check

    return register


@dataclass
class LintResult:
    """Findings of one lint run and what they were judged against.

    Attributes:
        workload: the workload's name.
        description: the workload's description.
        policy: the policy's label, e.g. 'bf16-mixed' or 'bf16-mixed+cl'.
        policy_chosen: True when lint picked the device's best default policy.
        device: the device the policy runs on, 'cpu: <name>' / 'cuda: <name>'.
        target: whose hardware the tensor-core rules judged.
        batch_size: the batch size traced.
        findings: active findings, most important first.
        suppressed: unavoidable cases, with the reason.
        ignored: the rule ids skipped.
        notes: what the findings do not say (rules that judged nothing, trace fallbacks, ...).
        trace_mode: how the forward pass was traced: 'meta', or 'eager' when the model needed real values.
        measured: --measure timed the mechanical fixes.
        policy_obj: the policy, for --measure; not part of the JSON.
        trace: the traced forward pass, for --measure; not part of the JSON.
    """

    workload: str
    description: str
    policy: str
    policy_chosen: bool
    device: str
    target: str
    batch_size: int
    findings: list[Finding]
    suppressed: list[Finding] = field(default_factory=list)
    ignored: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    trace_mode: str = "meta"
    measured: bool = False
    policy_obj: Policy | None = field(default=None, repr=False, compare=False)
    trace: Trace | None = field(default=None, repr=False, compare=False)

    def counts(self) -> dict[str, int]:
        """Active findings per severity, every severity present."""
        counts = dict.fromkeys(SEVERITIES, 0)
        for f in self.findings:
            counts[f.severity] += 1
        return counts

    @property
    def has_errors(self) -> bool:
        """An active finding is an error."""
        return any(f.severity == "error" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """The result for JSON (without the policy object and the trace)."""
        return {
            "workload": self.workload,
            "description": self.description,
            "policy": self.policy,
            "policy_chosen": self.policy_chosen,
            "device": self.device,
            "target": self.target,
            "batch_size": self.batch_size,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings],
            "suppressed": [f.to_dict() for f in self.suppressed],
            "ignored": list(self.ignored),
            "notes": list(self.notes),
            "trace_mode": self.trace_mode,
            "measured": self.measured,
        }


__all__ = [
    "SEVERITIES",
    "SEVERITY_RANK",
    "Check",
    "Finding",
    "LintFinding",
    "LintResult",
    "MeasuredGain",
    "Remedy",
    "Rule",
    "define_rule",
]
