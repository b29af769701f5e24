"""What `check` found: one :class:`CandidateCheck` per candidate, gathered in a :class:`CheckResult`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mixprec.policy import Candidate
from mixprec.schema import SCHEMA_VERSION, check_version, known_fields
from mixprec.status import Status


@dataclass
class CandidateCheck:
    """Verdict and evidence for one candidate against the strict-fp32 reference.

    Attributes:
        candidate: what was checked.
        verdict: pass, fail, at-risk (passes the checked steps but a trend predicts a failure
            within the run), error (nothing was tested: the format never ran), unsupported, or
            inconclusive (nothing failed, but the fp32 reference did not learn over the checked
            steps beyond its own run-to-run spread: the comparison had no power, so no pass).
        reason: the first failed criterion with its figure, or the margins of a pass.
        max_rel_loss_diff: largest |loss - loss_fp32| / |loss_fp32| over the checked steps.
        output_sqnr_db: SQNR of the model output at the first step (dB).
        min_grad_sqnr_db: the worst single parameter gradient's SQNR (evidence, not gated).
        median_grad_sqnr_db: the median parameter gradient's SQNR.
        total_grad_sqnr_db: all gradients as one vector (gated).
        skipped_steps: optimizer steps skipped on non-finite gradients in the compared run.
        scaler_warmup_skips: start-up back-off from the initial loss scale, before the compared run.
        stalled_update_fraction: *-true: share of weight updates lost to rounding.
        allowed_rel_loss_diff: the loss limit applied, after the chaos-floor allowance.
        required_output_sqnr_db / required_grad_sqnr_db: the SQNR floors applied.
        first_nonfinite_forward / first_nonfinite_backward: the first module producing inf/NaN.
        fix_keep_fp32: the keep_fp32 set the search found (``check --fix``).
        fix_keep_bf16: low-format policies: the precision map the search found (``check --fix``): the
            Linear layers, or ``layer:direction`` GEMMs, kept in bf16.
        precision_map: low-format policies: the Linear layers as the format sees them (shapes,
            operand SQNR in the format, the roofline's predicted speedup on a named GPU) and the
            share of the step's FLOPs in the format, whole-model and under the found map.
        fix_verified: that set passed a full re-run.
        fix_note: what the search did, or why it did not run.
        fix_metrics: figures of the verifying run.
        suggestion: the policy to try instead, for a failing candidate.
        losses, rel_loss_diff, scales: per step of the candidate's run.
        worst_grads: the five parameters with the lowest gradient SQNR.
        worst_layers: the five layers with the least headroom in the candidate's range format.
        grad_underflow_fp16: share of fp16 gradients that underflow with and without scaling.
        thresholds: the thresholds the verdict used.
        predicted: set when the candidate cannot run fast on this device and its numerics were
            computed here as a prediction (fp8 on a CPU): says how.
        series: per layer, its forward and (unscaled) backward abs-max at every checked step
            (:class:`mixprec.numerics.trend.LayerSeries` as dicts).
        run_headroom: the five layers whose headroom in the candidate's range format fell lowest over
            the checked steps, with the step (:func:`mixprec.numerics.trend.least_headroom`).
        stalls: *-true: the share of each step's weight updates that rounded away.
        outlook: what the series predict over ``train_steps`` (:class:`~mixprec.numerics.trend.Outlook`
            as a dict): the earliest supported crossing, one beyond the evidence's horizon.
        train_steps: the length of the run the verdict is about.
        evidence: what the verdict cannot see, in words (e.g. "not enough evidence: rerun with
            --steps 40"); empty when nothing is missing.
        spread_ratio: ``max_rel_loss_diff`` over the fp32 run-to-run spread on the same workload and
            steps (the chaos floor): at most 1 is within training randomness; None where fp32 runs
            do not drift apart at all.
        randomness: that comparison in words ("within training randomness: 0.12% against fp32's own
            run-to-run spread of 0.31%").
    """

    candidate: Candidate
    verdict: str
    reason: str
    max_rel_loss_diff: float | None = None
    output_sqnr_db: float | None = None
    min_grad_sqnr_db: float | None = None
    median_grad_sqnr_db: float | None = None
    total_grad_sqnr_db: float | None = None
    skipped_steps: int = 0
    scaler_warmup_skips: int = 0
    stalled_update_fraction: float | None = None
    allowed_rel_loss_diff: float | None = None
    required_output_sqnr_db: float | None = None
    required_grad_sqnr_db: float | None = None
    first_nonfinite_forward: str | None = None
    first_nonfinite_backward: str | None = None
    fix_keep_fp32: list[str] = field(default_factory=list)
    fix_keep_bf16: list[str] = field(default_factory=list)
    precision_map: dict[str, Any] | None = None
    fix_verified: bool = False
    fix_note: str = ""
    fix_metrics: dict[str, float | None] = field(default_factory=dict)
    suggestion: str | None = None
    losses: list[float] = field(default_factory=list)
    rel_loss_diff: list[float] = field(default_factory=list)
    scales: list[float | None] = field(default_factory=list)
    worst_grads: list[tuple[str, float]] = field(default_factory=list)
    worst_layers: list[dict[str, Any]] = field(default_factory=list)
    grad_underflow_fp16: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    predicted: str | None = None
    series: list[dict[str, Any]] = field(default_factory=list)
    run_headroom: list[dict[str, Any]] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)
    outlook: dict[str, Any] | None = None
    train_steps: int | None = None
    evidence: str = ""
    spread_ratio: float | None = None
    randomness: str = ""

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def passed(self) -> bool:
        return self.verdict == Status.PASS

    @property
    def acceptable(self) -> bool:
        """May be recommended: passed, or inconclusive (nothing failed; the reference did not learn,
        so the pick is on speed alone, labelled "numerics not verified")."""
        return self.verdict in (Status.PASS, Status.INCONCLUSIVE)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["candidate"] = self.candidate.to_dict()
        return {"label": self.label, "policy": self.candidate.policy, **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CandidateCheck:
        data = dict(data)
        if "candidate" not in data:  # schema 1: a label under "policy", the fix under "keep_fp32"
            label = str(data.get("policy", "fp32"))
            emulated = label.removesuffix(" (emulated)") if label.endswith(" (emulated)") else None
            data["candidate"] = {"policy": "fp32", "emulate": emulated} if emulated else {"policy": label}
            data.setdefault("fix_keep_fp32", data.get("keep_fp32") or [])
        kwargs = known_fields(cls, data)
        kwargs["candidate"] = Candidate.from_dict(data["candidate"])
        kwargs["worst_grads"] = [tuple(g) for g in data.get("worst_grads") or []]
        return cls(**kwargs)


@dataclass
class CheckResult:
    """Everything one `check` run measured: the fp32 reference, its chaos floor and each candidate.

    ``steps`` are the steps compared; ``asked_steps`` the steps asked for (more were checked where
    the reference did not learn over those, and the budget allowed). ``learns``: whether the fp32
    reference's loss fell over the compared steps beyond its batch-to-batch noise and its run-to-run
    spread (None in files written before it was recorded); ``reference_note`` says why not, and
    ``power`` what was done for it ("checked 16 steps: it did not learn over 8").
    """

    workload: str
    device: str
    batch_size: int
    steps: int
    reference_losses: list[float]
    candidates: list[CandidateCheck]
    reference_layers: list[dict[str, Any]] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)
    chaos_floor_rel_loss_diff: float | None = None
    chaos_floor_losses: list[float] = field(default_factory=list)
    chaos_floor_sqnr_db: dict[str, float | None] = field(default_factory=dict)
    # fp32 runs whose weights are one rounding of a half format apart, by format (bf16, fp16, tf32):
    # the loss floor of that format's candidates where it drifts further than the 2^-20 run
    format_floor_losses: dict[str, list[float]] = field(default_factory=dict)
    reference_note: str = ""
    learns: bool | None = None
    asked_steps: int | None = None
    power: str = ""

    @property
    def failed(self) -> list[CandidateCheck]:
        """The candidates that failed, are at risk within the run, or could not be tested (exit 4)."""
        return [c for c in self.candidates if c.verdict in (Status.FAIL, Status.AT_RISK, Status.ERROR)]

    @property
    def inconclusive(self) -> list[CandidateCheck]:
        """The candidates judged against a reference that did not learn (exit 6 when none failed)."""
        return [c for c in self.candidates if c.verdict == Status.INCONCLUSIVE]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "workload": self.workload,
            "device": self.device,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "reference_losses": self.reference_losses,
            "chaos_floor_rel_loss_diff": self.chaos_floor_rel_loss_diff,
            "chaos_floor_losses": self.chaos_floor_losses,
            "chaos_floor_sqnr_db": self.chaos_floor_sqnr_db,
            "format_floor_losses": self.format_floor_losses,
            "reference_note": self.reference_note,
            "learns": self.learns,
            "asked_steps": self.asked_steps,
            "power": self.power,
            "reference_layers": self.reference_layers,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckResult:
        data = check_version(data, "a check result")
        kwargs = known_fields(cls, data)
        kwargs["candidates"] = [CandidateCheck.from_dict(c) for c in data.get("candidates") or []]
        return cls(**kwargs)
