"""What `tune` measured, checked and decided: a :class:`TuneResult`, with its JSON form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixprec.measure.results import BenchResult
from mixprec.numerics.results import CheckResult
from mixprec.policy import Candidate
from mixprec.schema import SCHEMA_VERSION, check_version
from mixprec.status import read_status
from mixprec.tuning.decide import Ranked, Recommendation, fp32_by_default


@dataclass
class TuneResult:
    """Everything one tune run produced.

    Attributes:
        workload / description / device: what was tuned, where.
        recommendation: the pick, None when nothing passed.
        ranked: the decision table, one entry per measured candidate.
        bench: the speed sweep (with rescued and re-measured rows folded in).
        check: the numerics checks that ran, None when none did.
        lint: lint findings (dicts) under the recommended policy, None when not linted.
        exports: the pick as code or configuration, per export target that expresses it faithfully.
        export_refusals: per export target that cannot, why not and the nearest faithful alternative
            (:func:`mixprec.exports.export_all`); ``exports`` and ``export_refusals`` share no key.
        budget_s / elapsed_s: the time budget and the time spent.
        env: the environment block.
        created: UTC timestamp.
        notes: what the search skipped or adjusted, and why.
        command: the command line that produced it, when run from the CLI.
        budget_exhausted: when the budget cut candidates short and so the pick is strict fp32 or
            nothing, what it cut (the CLI exits 5); None when the pick stands on its own, or when
            tune was interrupted.
        interrupted: when a signal stopped tune before its budget ended, after how long and what it
            cut (the pick is from what was measured before it; never cached); None otherwise.
        phases: where the time went, seconds per stage in order: "speed" (the eager sweep and
            its late part), "numerics" (checks and rescues), "compile" (compiled candidates and
            their checks), "race" (the finalists measured against each other), "prediction" (fp8
            numerics predicted here), "other" (validation, lint, exports); "batch" first under
            ``--batch auto`` (each candidate's micro-batch under the memory budget).
        batches: under ``--batch auto``, the batch plan (:class:`mixprec.tuning.batching.BatchPlan`:
            the budget, each candidate's micro-batch and memory model, the share of the grid timed).
    """

    workload: str
    description: str
    device: str
    recommendation: Recommendation | None
    ranked: list[Ranked]
    bench: BenchResult
    check: CheckResult | None
    lint: list[dict[str, Any]] | None
    budget_s: float
    elapsed_s: float
    env: dict[str, Any]
    created: str
    notes: list[str] = field(default_factory=list)
    exports: dict[str, str] = field(default_factory=dict)
    export_refusals: dict[str, str] = field(default_factory=dict)
    command: str | None = None
    budget_exhausted: str | None = None
    interrupted: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    batches: dict[str, Any] | None = None

    @property
    def fp32_by_default(self) -> bool:
        """Strict fp32 stands by default: the budget left a lower precision unmeasured, none ran
        (:func:`mixprec.tuning.decide.fp32_by_default`)."""
        return fp32_by_default(self.ranked)

    def to_dict(self) -> dict[str, Any]:
        rec = self.recommendation
        return {
            "schema_version": SCHEMA_VERSION,
            "command": self.command,
            "workload": self.workload,
            "description": self.description,
            "device": self.device,
            "created": self.created,
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s,
            "notes": self.notes,
            "budget_exhausted": self.budget_exhausted,
            "interrupted": self.interrupted,
            "phases": self.phases,
            "bench": self.bench.to_dict(),
            "check": self.check.to_dict() if self.check else None,
            "lint": {"findings": self.lint} if self.lint is not None else None,
            "candidates": [r.to_dict() for r in self.ranked],
            "recommendation": rec.to_dict() if rec else None,
            "exports": self.exports,
            "export_refusals": self.export_refusals,
            "batches": self.batches,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuneResult:
        """Read a :meth:`to_dict` (or ``mixprec tune --json``) payload back, schema 1 included."""
        data = check_version(data, "a tune result")
        bench = BenchResult.from_dict({**(data.get("bench") or {}), "env": data.get("env") or {}})
        rows = {(r.candidate, r.baseline_repeat): r for r in bench.rows}
        ranked = []
        for entry in data.get("candidates") or []:
            cand = Candidate.from_dict(entry.get("candidate") or entry)
            ranked.append(
                Ranked(
                    cand,
                    read_status(entry.get("status", "")),
                    entry.get("reason", ""),
                    entry.get("verdict"),
                    rows.get((cand, False)),
                )
            )
        rec = data.get("recommendation")
        lint = data.get("lint")
        return cls(
            workload=data.get("workload", ""),
            description=data.get("description", ""),
            device=data.get("device", ""),
            recommendation=Recommendation.from_dict(rec) if rec else None,
            ranked=ranked,
            bench=bench,
            check=CheckResult.from_dict(data["check"]) if data.get("check") else None,
            lint=list(lint.get("findings") or []) if isinstance(lint, dict) else None,
            budget_s=float(data.get("budget_s") or 0.0),
            elapsed_s=float(data.get("elapsed_s") or 0.0),
            env=data.get("env") or {},
            created=data.get("created", ""),
            notes=list(data.get("notes") or []),
            exports=dict(data.get("exports") or {}),
            export_refusals=dict(data.get("export_refusals") or {}),
            command=data.get("command"),
            budget_exhausted=data.get("budget_exhausted"),
            interrupted=data.get("interrupted"),
            phases={str(k): float(v) for k, v in (data.get("phases") or {}).items()},
            batches=data.get("batches"),
        )
