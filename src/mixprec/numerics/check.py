"""`check`: does a policy train like fp32? Where does it break, and which fp32 islands fix it?

For every candidate: a differential training run against a strict-fp32 reference (see
``compare``), per-layer ranges under the candidate (first non-finite module forward and
backward), a verdict against per-policy thresholds, and on request a search for a small
``keep_fp32`` set that makes a failing candidate pass, verified by re-running the check.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from mixprec.errors import UsageError
from mixprec.hardware.device import detect, resolve_device
from mixprec.measure.runner import make_batches
from mixprec.numerics.compare import Comparison, Trajectory, compare, run_trajectory
from mixprec.policy import Policy, canonical_name, check_support, get_policy
from mixprec.workload import Workload

# Formats that can be emulated without loss scaling (fp16 would need a scaler; it runs
# natively on every CPU anyway, so check fp16-mixed instead).
EMULATABLE = ("tf32", "bf16", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class Thresholds:
    """A candidate passes when all of these hold over the differential run.

    max_rel_loss_diff: allowed max over steps of |loss - loss_fp32| / |loss_fp32|, at least;
        the allowance grows to ``chaos_factor`` x the fp32 chaos floor (see below).
    min_output_sqnr_db: SQNR of the model output at the first step.
    min_grad_sqnr_db: SQNR of all parameter gradients together (one vector) at the first step.
    max_skip_fraction: optimizer steps skipped on non-finite gradients / steps, after the
        loss scale has settled (start-up back-off is reported, not counted).

    The chaos floor is an fp32 run whose initial weights differ by one part in 2^20: how far
    two fp32 runs drift apart on this model in the same steps. Deep nets at initialisation
    amplify any rounding difference, so a fixed loss tolerance would fail every format on
    them while passing anything on a shallow model.
    """

    max_rel_loss_diff: float
    min_output_sqnr_db: float
    min_grad_sqnr_db: float
    max_skip_fraction: float = 0.0
    chaos_factor: float = 3.0
    # *-true policies: the fraction of weights with a gradient whose update rounded away
    max_stalled_update_fraction: float = 0.05


# Calibrated on the zoo on this project's CPU (docs/check.md has the figures and commands).
# The SQNR floors are guards against catastrophic error (overflow, a layer computing garbage):
# resnet50 at initialisation amplifies rounding noise by ~35 dB, so healthy bf16 there shows
# ~10 dB output SQNR while an MLP shows ~45 dB. The loss trajectory against the chaos floor
# decides the rest.
DEFAULT_THRESHOLDS: dict[str, Thresholds] = {
    "fp32": Thresholds(1e-6, 100.0, 100.0),
    "tf32": Thresholds(1e-2, 15.0, 10.0),
    "bf32": Thresholds(2e-2, 5.0, 3.0),
    "bf16-mixed": Thresholds(2e-2, 5.0, 3.0),
    "fp16-mixed": Thresholds(1e-2, 10.0, 6.0, max_skip_fraction=0.25),
    "bf16-true": Thresholds(5e-2, 5.0, 0.0),
    "fp16-true": Thresholds(2e-2, 10.0, 3.0, max_skip_fraction=0.25),
    "emulated:tf32": Thresholds(1e-2, 15.0, 10.0),
    "emulated:bf16": Thresholds(2e-2, 5.0, 3.0),
    "emulated:fp8_e4m3": Thresholds(1e-1, 3.0, 0.0),
    "emulated:fp8_e5m2": Thresholds(1e-1, 0.0, -3.0),
}

CHAOS_PERTURBATION = 2.0**-20
# SQNR of that perturbation itself: 20*log10(1 / 2^-20).
_CHAOS_INPUT_SQNR_DB = 20 * math.log10(1 / CHAOS_PERTURBATION)
# How much worse than the format's rounding, propagated like the chaos perturbation, a
# candidate may be: rounding hits every layer's inputs, not the weights once (~10*log10(depth)).
SQNR_MARGIN_DB = 20.0


def rounding_sqnr_db(fmt: str) -> float:
    """SQNR of rounding to ``fmt`` (round-to-nearest, p significand bits): 6.02*p + 4.77 dB."""
    from mixprec.numerics.limits import FORMATS

    p = FORMATS[fmt].mantissa_bits + 1
    return 20 * math.log10(math.sqrt(3) * 2.0**p)


@dataclass(frozen=True)
class Floor:
    """How far two fp32 runs 2^-20 apart drift: loss difference and first-step SQNRs."""

    rel_loss_diff: float = 0.0
    output_sqnr_db: float | None = None
    grad_sqnr_db: float | None = None

    def required(self, absolute: float, floor_sqnr: float | None, fmt: str) -> float:
        """The SQNR floor for a candidate in ``fmt``: the absolute guard, lowered on models that
        amplify noise so much that even the format's own rounding could not reach it."""
        if floor_sqnr is None or not math.isfinite(floor_sqnr):
            return absolute
        amplification = _CHAOS_INPUT_SQNR_DB - floor_sqnr
        return min(absolute, rounding_sqnr_db(fmt) - amplification - SQNR_MARGIN_DB)


@dataclass
class CandidateCheck:
    """Verdict and evidence for one candidate (JSON keys as the output contract asks)."""

    policy: str
    verdict: str  # pass | fail | unsupported
    reason: str
    max_rel_loss_diff: float | None = None
    output_sqnr_db: float | None = None
    min_grad_sqnr_db: float | None = None  # the worst single parameter (evidence, not gated)
    median_grad_sqnr_db: float | None = None
    total_grad_sqnr_db: float | None = None  # all gradients as one vector (gated)
    skipped_steps: int = 0
    scaler_warmup_skips: int = 0  # start-up back-off from the init scale, before the compared run
    stalled_update_fraction: float | None = None  # *-true: weight updates lost to rounding
    allowed_rel_loss_diff: float | None = None  # after the chaos-floor allowance
    required_output_sqnr_db: float | None = None  # the floors applied, after the amplification adjustment
    required_grad_sqnr_db: float | None = None
    first_nonfinite_forward: str | None = None
    first_nonfinite_backward: str | None = None
    keep_fp32: list[str] = field(default_factory=list)
    fix_verified: bool = False
    fix_note: str = ""
    fix_metrics: dict[str, float | None] = field(default_factory=dict)  # of the verifying run
    suggestion: str | None = None
    emulated: str | None = None
    losses: list[float] = field(default_factory=list)
    rel_loss_diff: list[float] = field(default_factory=list)
    scales: list[float | None] = field(default_factory=list)
    worst_grads: list[tuple[str, float]] = field(default_factory=list)
    worst_layers: list[dict[str, Any]] = field(default_factory=list)
    grad_underflow_fp16: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CheckResult:
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

    @property
    def failed(self) -> list[CandidateCheck]:
        return [c for c in self.candidates if c.verdict == "fail"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "device": self.device,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "reference_losses": self.reference_losses,
            "chaos_floor_rel_loss_diff": self.chaos_floor_rel_loss_diff,
            "chaos_floor_losses": self.chaos_floor_losses,
            "chaos_floor_sqnr_db": self.chaos_floor_sqnr_db,
            "reference_layers": self.reference_layers,
            "candidates": [c.to_dict() for c in self.candidates],
        }


Progress = Callable[[str], None]


@dataclass(frozen=True)
class _Candidate:
    """A policy to check, possibly an fp32 policy run under format emulation."""

    label: str
    policy_name: str
    emulated: str | None = None

    @property
    def threshold_key(self) -> str:
        return f"emulated:{self.emulated}" if self.emulated else self.policy_name


def _emulation_context(fmt: str | None) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    if fmt is None:
        return None
    from mixprec.numerics.emulate import emulate

    return lambda: emulate(fmt)


def _judge(
    cmp: Comparison, traj: Trajectory, thr: Thresholds, steps: int, floor: Floor, fmt: str
) -> tuple[bool, str]:
    """(passed, reason). The reason names the first criterion that failed, with the figure."""
    if traj.error:
        return False, f"training crashed: {traj.error}"
    if cmp.nonfinite_loss_step is not None:
        return False, f"loss became non-finite at step {cmp.nonfinite_loss_step}"
    if steps and cmp.skipped_steps / steps > thr.max_skip_fraction:
        return False, f"{cmp.skipped_steps}/{steps} optimizer steps skipped on non-finite gradients"
    stalled = traj.stalled_update_fraction
    if stalled is not None and stalled > thr.max_stalled_update_fraction:
        return False, (
            f"{stalled:.0%} of the weight updates rounded away in half-precision storage (limit "
            f"{thr.max_stalled_update_fraction:.0%}): without fp32 master weights this model stops learning; "
            "use the *-mixed policy"
        )
    allowed = allowed_rel_loss_diff(thr, floor.rel_loss_diff)
    if cmp.max_rel_loss_diff > allowed:
        return False, (
            f"loss differs from fp32 by {cmp.max_rel_loss_diff:.2%} (allowed {allowed:.2%}; two fp32 runs "
            f"drift {floor.rel_loss_diff:.2%} apart here)"
        )
    need_out = floor.required(thr.min_output_sqnr_db, floor.output_sqnr_db, fmt)
    if cmp.output_sqnr_db is not None and cmp.output_sqnr_db < need_out:
        return False, f"output SQNR {cmp.output_sqnr_db:.1f} dB < {need_out:.1f} dB required"
    need_grad = floor.required(thr.min_grad_sqnr_db, floor.grad_sqnr_db, fmt)
    if cmp.total_grad_sqnr_db is not None and cmp.total_grad_sqnr_db < need_grad:
        return False, f"gradient SQNR {cmp.total_grad_sqnr_db:.1f} dB < {need_grad:.1f} dB required"
    margin = []
    if cmp.output_sqnr_db is not None:
        margin.append(f"output SQNR {cmp.output_sqnr_db:.1f} dB (>= {need_out:.1f})")
    if cmp.total_grad_sqnr_db is not None:
        margin.append(f"gradient SQNR {cmp.total_grad_sqnr_db:.1f} dB (>= {need_grad:.1f})")
    margin.append(f"max loss diff {cmp.max_rel_loss_diff:.2%} (<= {allowed:.2%})")
    return True, "matches fp32: " + ", ".join(margin)


def allowed_rel_loss_diff(thr: Thresholds, floor: float) -> float:
    return max(thr.max_rel_loss_diff, thr.chaos_factor * floor)


def _ranges(workload: Workload, policy: Policy, batch: Any, context: Any, loss_scale: float | None) -> Any:
    """Per-layer ranges of one forward/backward of a fresh prepared copy under ``policy``."""
    from mixprec.numerics.ranges import collect_ranges

    model = policy.prepare(copy.deepcopy(workload.model))
    model.train()
    ctx = context or contextlib.nullcontext

    def step() -> torch.Tensor:
        with ctx(), policy.autocast():
            return workload.loss_fn(model, batch)

    with policy.precision_scope(), ctx():
        return collect_ranges(model, step, loss_scale=loss_scale)


def _worst_layers(report: Any, fmt: str, n: int = 5) -> list[dict[str, Any]]:
    rows = []
    for layer in report.worst(n, fmt):
        fwd, bwd = layer.forward, layer.backward
        rows.append(
            {
                "layer": layer.name,
                "type": layer.type,
                "format": fmt,
                "forward_absmax": fwd.absmax,
                "forward_headroom_bits": fwd.headroom_bits(fmt),
                "forward_overflow": fwd.overflow_fraction(fmt),
                "backward_absmax": bwd.absmax,
                "backward_headroom_bits": bwd.headroom_bits(fmt),
                "backward_underflow": bwd.underflow_fraction(fmt),
            }
        )
    return rows


def _layer_headroom(report: Any) -> list[dict[str, Any]]:
    """Per layer, in execution order: headroom in bits per low-precision format, both passes."""
    from mixprec.numerics.limits import LOW_PRECISION_FORMATS

    return [
        {
            "layer": layer.name,
            "type": layer.type,
            "forward_headroom_bits": {f: layer.forward.headroom_bits(f) for f in LOW_PRECISION_FORMATS},
            "backward_headroom_bits": {f: layer.backward.headroom_bits(f) for f in LOW_PRECISION_FORMATS},
        }
        for layer in report.layers
        if layer.name  # the root's output is the loss input; it is the last layer anyway
    ]


def _rounding_format(cand: _Candidate) -> str:
    """The format whose rounding bounds the candidate's precision (bf32 rounds like bf16)."""
    if cand.emulated:
        return cand.emulated
    if cand.policy_name in ("fp32",):
        return "fp32"
    if cand.policy_name == "tf32":
        return "tf32"
    return _format_of(cand)


def _format_of(cand: _Candidate) -> str:
    """The low-precision format whose range limits the candidate (tf32/bf32 have bf16's exponent range)."""
    if cand.emulated:
        return "bf16" if cand.emulated == "tf32" else cand.emulated
    return "fp16" if _Checker.spec_of(cand).low_precision_dtype == torch.float16 else "bf16"


class _Checker:
    """Holds what every candidate shares: batches, the reference run and its ranges."""

    def __init__(
        self,
        workload: Workload,
        device: torch.device,
        batch_size: int,
        steps: int,
        thresholds: dict[str, Thresholds],
        progress: Progress,
        deadline: float = math.inf,
    ) -> None:
        self.workload, self.device, self.steps = workload, device, steps
        self.deadline = deadline  # time.perf_counter() value after which searches stop
        self.batch_size = batch_size
        self.thresholds = thresholds
        self.progress = progress
        self.batches = make_batches(workload, batch_size, device, 0, steps)
        progress("fp32 reference")
        self.reference = run_trajectory(workload, get_policy("fp32", device=device), self.batches, steps)
        if self.reference.error:
            raise UsageError(f"the fp32 reference run of {workload.name!r} failed: {self.reference.error}")
        self.reference_ranges = _ranges(
            workload, get_policy("fp32", device=device), self.batches[0], None, None
        )
        progress("fp32 chaos floor")
        self.chaos = run_trajectory(
            workload, get_policy("fp32", device=device), self.batches, steps, perturb=CHAOS_PERTURBATION
        )
        chaos_cmp = compare(self.reference, self.chaos)
        self.floor = (
            Floor(chaos_cmp.max_rel_loss_diff, chaos_cmp.output_sqnr_db, chaos_cmp.total_grad_sqnr_db)
            if not self.chaos.error
            else Floor()
        )

    @staticmethod
    def spec_of(cand: _Candidate) -> Any:
        from mixprec.policy import POLICIES

        return POLICIES[cand.policy_name]

    def policy(self, cand: _Candidate, keep_fp32: Sequence[str] = ()) -> Policy:
        options: dict[str, Any] = {"keep_fp32": list(keep_fp32)} if keep_fp32 else {}
        return get_policy(cand.policy_name, device=self.device, **options)

    def run(self, cand: _Candidate, keep_fp32: Sequence[str] = (), steps: int | None = None) -> tuple:
        steps = steps or self.steps
        policy = self.policy(cand, keep_fp32)
        traj = run_trajectory(
            self.workload,
            policy,
            self.batches,
            steps,
            context=_emulation_context(cand.emulated),
            label=cand.label,
        )
        ref = replace(self.reference, losses=self.reference.losses[:steps])
        cmp = compare(ref, traj)
        floor = replace(
            self.floor,
            rel_loss_diff=compare(
                ref, replace(self.chaos, losses=self.chaos.losses[:steps])
            ).max_rel_loss_diff,
        )
        passed, reason = _judge(
            cmp, traj, self.thresholds[cand.threshold_key], steps, floor, _rounding_format(cand)
        )
        return passed, reason, cmp, traj, policy

    def check(self, cand: _Candidate, fix: bool) -> CandidateCheck:
        self.progress(cand.label)
        passed, reason, cmp, traj, policy = self.run(cand)
        thr = self.thresholds[cand.threshold_key]
        result = CandidateCheck(
            policy=cand.label,
            verdict="pass" if passed else "fail",
            reason=reason,
            max_rel_loss_diff=cmp.max_rel_loss_diff,
            output_sqnr_db=cmp.output_sqnr_db,
            min_grad_sqnr_db=cmp.min_grad_sqnr_db,
            median_grad_sqnr_db=cmp.median_grad_sqnr_db,
            total_grad_sqnr_db=cmp.total_grad_sqnr_db,
            skipped_steps=cmp.skipped_steps,
            scaler_warmup_skips=traj.warmup_skips,
            stalled_update_fraction=traj.stalled_update_fraction,
            allowed_rel_loss_diff=allowed_rel_loss_diff(thr, self.floor.rel_loss_diff),
            required_output_sqnr_db=self.floor.required(
                thr.min_output_sqnr_db, self.floor.output_sqnr_db, _rounding_format(cand)
            ),
            required_grad_sqnr_db=self.floor.required(
                thr.min_grad_sqnr_db, self.floor.grad_sqnr_db, _rounding_format(cand)
            ),
            emulated=cand.emulated,
            losses=traj.losses,
            rel_loss_diff=cmp.rel_loss_diff,
            scales=traj.scales,
            worst_grads=sorted(cmp.grad_sqnr_db.items(), key=lambda kv: kv[1])[:5],
            thresholds=asdict(thr),
        )
        fmt = _format_of(cand)
        try:
            ranges = _ranges(
                self.workload, policy, self.batches[0], _emulation_context(cand.emulated), traj.probe_scale
            )
            result.first_nonfinite_forward = ranges.first_nonfinite_forward
            result.first_nonfinite_backward = ranges.first_nonfinite_backward
            result.grad_underflow_fp16 = dict(ranges.grad_underflow_fp16)
        except Exception as exc:  # ranges are evidence; their failure must not hide the verdict
            result.fix_note = f"per-layer ranges unavailable: {type(exc).__name__}: {exc}"
        result.worst_layers = _worst_layers(self.reference_ranges, fmt)
        if not passed:
            result.suggestion = self._suggest(cand, result, fmt)
            if result.first_nonfinite_forward and "non-finite" in reason:
                result.reason += f"; first non-finite output in {result.first_nonfinite_forward!r}"
            if fix and self.spec_of(cand).low_precision_dtype is None:
                result.fix_note = (
                    f"{cand.label} is a global fp32 math mode (no autocast): fp32 islands cannot fix it; "
                    "use fp32 or a *-mixed policy"
                )
            elif fix and time.perf_counter() > self.deadline:
                result.fix_note = "keep_fp32 search skipped: time budget spent"
            elif fix:
                self._search_fix(cand, result, fmt)
        return result

    @staticmethod
    def _suggest(cand: _Candidate, result: CandidateCheck, fmt: str) -> str:
        overflow = result.first_nonfinite_forward or result.first_nonfinite_backward or result.skipped_steps
        if fmt == "fp16" and overflow:
            return "fp16 overflows here: try bf16-mixed (same speed class, fp32's range)"
        if fmt == "bf16":
            return "bf16 loses too much precision here: try fp16-mixed or tf32"
        return "keep the failing layers in fp32 (keep_fp32=[...]) or use fp32/tf32"

    # ---------------------------------------------------------------- keep-fp32 search
    def _search_space(self, result: CandidateCheck, fmt: str) -> list[str]:
        """Modules to try in fp32, most suspicious first: located non-finite modules, then the
        layers with the least headroom in this format, then those with the worst gradients."""
        names = [n for n, m in self.workload.model.named_modules() if n]
        ordered: list[str] = []

        def add(name: str | None) -> None:
            if name and name in names and name not in ordered:
                ordered.append(name)

        add(result.first_nonfinite_forward)
        add(result.first_nonfinite_backward)
        for layer in self.reference_ranges.worst(len(names), fmt):
            add(layer.name)
        param_owner = {n: n.rsplit(".", 1)[0] for n, _ in self.workload.model.named_parameters() if "." in n}
        for pname, _ in result.worst_grads:
            add(param_owner.get(pname))
        return ordered

    def _search_fix(self, cand: _Candidate, result: CandidateCheck, fmt: str, max_set: int = 8) -> None:
        """Grow a keep_fp32 set from the evidence until the candidate passes, then shrink it."""
        order = self._search_space(result, fmt)
        search_steps = min(self.steps, 4)
        chosen: list[str] = []
        passed = False
        for name in order[:max_set]:
            if time.perf_counter() > self.deadline:
                break
            chosen.append(name)
            self.progress(f"{cand.label}: trying keep_fp32={chosen}")
            passed = self.run(cand, chosen, search_steps)[0]
            if passed:
                break
        if not passed:
            alt = result.suggestion or "another format"
            result.fix_note = (
                f"no set of up to {max_set} fp32 modules makes {cand.label} pass "
                f"(tried {', '.join(order[:max_set]) or 'none'}); {alt}"
            )
            return
        # Delta-debugging-style minimisation: drop every module the candidate passes without.
        for name in list(chosen):
            if time.perf_counter() > self.deadline:
                break
            trial = [n for n in chosen if n != name]
            if trial and self.run(cand, trial, search_steps)[0]:
                chosen = trial
        self.progress(f"{cand.label}: verifying keep_fp32={chosen}")
        verified, reason, cmp, *_ = self.run(cand, chosen)
        result.keep_fp32 = chosen
        result.fix_verified = verified
        result.fix_metrics = {
            "max_rel_loss_diff": cmp.max_rel_loss_diff,
            "output_sqnr_db": cmp.output_sqnr_db,
            "total_grad_sqnr_db": cmp.total_grad_sqnr_db,
            "min_grad_sqnr_db": cmp.min_grad_sqnr_db,
            "skipped_steps": cmp.skipped_steps,
        }
        result.fix_note = (
            f"verified over {self.steps} steps: {reason}"
            if verified
            else f"passes over {search_steps} steps but not over {self.steps}: {reason}"
        )


def _plan(policies: Sequence[str], emulate_fmts: Sequence[str], device: torch.device) -> list[_Candidate]:
    cands = [_Candidate(canonical_name(p), canonical_name(p)) for p in policies]
    for fmt in emulate_fmts:
        if fmt not in EMULATABLE:
            raise UsageError(
                f"Cannot emulate {fmt!r}; valid: {', '.join(EMULATABLE)}. "
                "fp16 runs natively on every CPU: check fp16-mixed instead."
            )
        cands.append(_Candidate(f"{fmt} (emulated)", "fp32", emulated=fmt))
    return cands


def make_checker(
    workload: Workload,
    *,
    steps: int = 8,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    thresholds: dict[str, Thresholds] | None = None,
    progress: Progress | None = None,
    deadline: float = math.inf,
) -> _Checker:
    """Run the fp32 reference, its per-layer ranges and the chaos floor once, for many checks."""
    if not isinstance(workload, Workload):
        raise UsageError(f"check() takes a mixprec.Workload, got {type(workload).__name__}.")
    if not isinstance(steps, int) or steps < 1:
        raise UsageError(f"steps must be an integer >= 1, got {steps!r}.")
    dev = resolve_device(device)
    merged = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    bs = batch_size or workload.default_batch_size
    return _Checker(workload, dev, bs, steps, merged, progress or (lambda msg: None), deadline)


def check(
    workload: Workload,
    *,
    policies: Sequence[str] = ("bf16-mixed", "fp16-mixed"),
    emulate: Sequence[str] = (),
    steps: int = 8,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    fix: bool = False,
    thresholds: dict[str, Thresholds] | None = None,
    progress: Progress | None = None,
    deadline: float = math.inf,
    checker: _Checker | None = None,
) -> CheckResult:
    """Check each policy (and each emulated format) against an fp32 reference on ``workload``.

    ``deadline`` (a ``time.perf_counter()`` value) stops keep-fp32 searches once passed.
    ``checker`` (from :func:`make_checker`) reuses an fp32 reference, its ranges and the chaos
    floor across calls, e.g. when candidates are checked one at a time.
    """
    if checker is None:
        checker = make_checker(
            workload,
            steps=steps,
            batch_size=batch_size,
            device=device,
            thresholds=thresholds,
            progress=progress,
            deadline=deadline,
        )
    workload, dev, steps, bs = checker.workload, checker.device, checker.steps, checker.batch_size
    info = detect(dev)
    cands = _plan(policies, emulate, dev)
    results = []
    for cand in cands:
        support = check_support(cand.policy_name, info)
        if not support:
            results.append(
                CandidateCheck(cand.label, "unsupported", support.reason, suggestion=support.suggestion)
            )
            continue
        results.append(checker.check(cand, fix))
    return CheckResult(
        workload=str(workload.name),
        device=str(dev),
        batch_size=bs,
        steps=steps,
        reference_losses=checker.reference.losses,
        chaos_floor_rel_loss_diff=checker.floor.rel_loss_diff,
        chaos_floor_sqnr_db={"output": checker.floor.output_sqnr_db, "grad": checker.floor.grad_sqnr_db},
        chaos_floor_losses=checker.chaos.losses,
        candidates=results,
        reference_layers=_layer_headroom(checker.reference_ranges),
    )
