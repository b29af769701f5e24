"""Presentation of lint results: a short table that groups repeated findings, and the rule list."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mixprec.linting import RULES, Finding, LintResult, Rule

_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
_NAMES_SHOWN = 3
MAX_ROWS_PER_RULE = 4


@dataclass
class FindingGroup:
    """Findings of one rule with the same message and fix (e.g. the same padding in 12 layers)."""

    rule: str
    name: str
    severity: str
    message: str
    fix: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return [f.where for f in self.findings]

    @property
    def where(self) -> str:
        names = self.modules
        if len(names) == 1:
            return names[0]
        shown = ", ".join(names[:_NAMES_SHOWN])
        more = f", +{len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
        return f"{len(names)} layers: {shown}{more}"

    @property
    def label(self) -> str:
        """'MP101' or 'MP101 x 12' for a group."""
        n = len(self.findings)
        return self.rule if n == 1 else f"{self.rule} x {n}"


def group_findings(
    findings: Iterable[Finding], max_rows_per_rule: int = MAX_ROWS_PER_RULE
) -> list[FindingGroup]:
    """Merge findings of one rule that say and fix the same thing; keep at most
    ``max_rows_per_rule`` rows per rule (the rest become one 'and N more' row).

    Measured findings are never merged: each has its own figures. Order follows ``findings``.
    """
    groups: list[FindingGroup] = []
    by_key: dict[tuple, FindingGroup] = {}
    for f in findings:
        key = (f.rule, f.severity, f.message, f.fix)
        if f.measured is None and key in by_key:
            by_key[key].findings.append(f)
            continue
        group = FindingGroup(f.rule, f.name, f.severity, f.message, f.fix, [f])
        groups.append(group)
        if f.measured is None:
            by_key[key] = group
    out: list[FindingGroup] = []
    per_rule: dict[str, list[FindingGroup]] = {}
    for g in groups:
        per_rule.setdefault(g.rule, []).append(g)
    overflow: dict[str, FindingGroup] = {}
    for g in groups:
        rule_groups = per_rule[g.rule]
        if len(rule_groups) <= max_rows_per_rule or rule_groups.index(g) < max_rows_per_rule - 1:
            out.append(g)
            continue
        rest = overflow.get(g.rule)
        if rest is None:
            rest = FindingGroup(g.rule, g.name, g.severity, "", "see --verbose or --json")
            overflow[g.rule] = rest
            out.append(rest)
        rest.findings.extend(g.findings)
        if g.severity == "error" or (g.severity == "warning" and rest.severity == "info"):
            rest.severity = g.severity
    for rest in overflow.values():
        rest.message = f"... and {len(rest.findings)} more findings of this rule, with other sizes"
    return out


def _ms(before: float | None, after: float | None) -> str:
    if before is None or after is None:
        return ""
    return f"{before:.2f} -> {after:.2f}"


def _gain(value: float | None) -> Text:
    if value is None:
        return Text("")
    style = "green" if value > 0 else "red" if value < 0 else ""
    return Text(f"{value:+.1f}%", style=style)


def _header(result: LintResult) -> Text:
    chosen = " (the best default here)" if result.policy_chosen else ""
    text = Text.assemble(("mixprec lint", "bold"), f": {result.workload}")
    if result.description:
        text.append(f" - {result.description}")
    text.append(
        f"\npolicy {result.policy}{chosen} on {result.device}; batch {result.batch_size}; "
        f"tensor-core rules judged for {result.target}"
    )
    return text


def _summary(result: LintResult) -> Text:
    counts = result.counts()
    plural = {"error": "errors", "warning": "warnings", "info": "info"}
    parts = [f"{counts[s]} {s if counts[s] == 1 else plural[s]}" for s in ("error", "warning", "info")]
    text = Text(", ".join(parts), style="bold red" if counts["error"] else "")
    extra = []
    if result.suppressed:
        extra.append(f"{len(result.suppressed)} suppressed")
    if result.ignored:
        extra.append(f"ignored: {', '.join(result.ignored)}")
    if extra:
        text.append(f" ({'; '.join(extra)})")
    text.append(". `mixprec lint --list-rules` explains every rule; --ignore ID silences one.", style="dim")
    return text


def lint_report(result: LintResult, *, verbose: bool = False) -> Group:
    """The lint report: header, findings table (grouped unless ``verbose``), suppressed, notes."""
    parts: list = [_header(result)]
    measured = any(f.measured is not None for f in result.findings)
    if result.findings:
        table = Table(title_justify="left", show_lines=verbose)
        table.add_column("rule", no_wrap=True)
        table.add_column("severity", no_wrap=True)
        table.add_column("where", overflow="fold")
        table.add_column("finding", overflow="fold")
        table.add_column("fix", overflow="fold")
        if measured:
            table.add_column("layer ms", justify="right", no_wrap=True)
            table.add_column("step ms", justify="right", no_wrap=True)
            table.add_column("gain", justify="right", no_wrap=True)
        groups = (
            [FindingGroup(f.rule, f.name, f.severity, f.message, f.fix, [f]) for f in result.findings]
            if verbose
            else group_findings(result.findings)
        )
        for g in groups:
            first = g.findings[0]
            finding = Text(g.message)
            if first.shape and len(g.findings) == 1:
                finding.append(f"\n{first.shape}", style="dim")
            elif first.shape:
                finding.append(f"\ne.g. {first.shape}", style="dim")
            row: list = [
                Text(f"{g.label}\n{g.name}"),
                Text(g.severity, style=_SEVERITY_STYLE[g.severity]),
                g.where,
                finding,
                g.fix,
            ]
            if measured:
                m = first.measured if len(g.findings) == 1 else None
                if m is None:
                    row += ["", "", Text("")]
                else:
                    row += [
                        _ms(m.layer_before_ms, m.layer_after_ms),
                        _ms(m.step_before_ms, m.step_after_ms),
                        _gain(m.gain_pct),
                    ]
            table.add_row(*row)
        parts.append(table)
    else:
        parts.append(Text("no findings.", style="green"))
    if measured:
        parts.append(
            Text(
                "layer ms: forward+backward of the layer(s) as if built with the fixed sizes/layout; "
                "step ms: whole training step, original vs a drop-in fixed copy (same outputs); "
                "gain: the step's, else the layer's. Measured on this device; not asserted.",
                style="dim",
            )
        )
        for f in result.findings:
            if f.measured is not None and f.measured.note:
                parts.append(Text(f"  {f.rule} {f.where}: {f.measured.note}", style="dim"))
    if result.suppressed:
        parts.append(Text("suppressed (unavoidable):"))
        for f in result.suppressed:
            parts.append(Text(f"  {f.rule} {f.where}: {f.suppressed}", style="dim"))
    if result.notes:
        parts.append(Text("notes:"))
        for note in result.notes:
            parts.append(Text(f"  {note}", style="dim"))
    if verbose and result.findings:
        parts.append(Text("rules:"))
        for rule_id in dict.fromkeys(f.rule for f in result.findings):
            rule = RULES[rule_id]
            parts.append(
                Text(f"  {rule.id} {rule.name}: {rule.rationale} Source: {rule.source}", style="dim")
            )
    parts.append(_summary(result))
    return Group(*parts)


def rules_table(rules: Iterable[Rule] | None = None, *, verbose: bool = False) -> Table:
    """Every rule: id, name, top severity, whether --measure times its fix, summary and source."""
    table = Table(title="mixprec lint rules", title_justify="left", show_lines=verbose)
    table.add_column("id", no_wrap=True)
    table.add_column("name", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("measured", no_wrap=True)
    table.add_column("what" if not verbose else "what, why", overflow="fold")
    table.add_column("source", overflow="fold")
    for rule in rules if rules is not None else RULES.values():
        what = Text(rule.summary)
        if verbose:
            what.append(f"\n{rule.rationale}", style="dim")
        table.add_row(
            rule.id,
            rule.name,
            Text(rule.severity, style=_SEVERITY_STYLE[rule.severity]),
            "yes" if rule.mechanical else "",
            what,
            rule.source,
        )
    return table


__all__ = ["FindingGroup", "group_findings", "lint_report", "rules_table"]
