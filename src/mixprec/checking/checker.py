"""Each candidate's check against the workload's :class:`~mixprec.checking.reference.Reference`:
its verdict, evidence (per-layer ranges, the first non-finite layer, the precision map's facts) and
advice, and on request a small ``keep_fp32`` set or precision map that makes it pass, verified."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from mixprec.checking.config import TRAIN_STEPS_SETTING
from mixprec.checking.reference import NEVER_RAN, Reference, range_format, rounding_format
from mixprec.hardware.device import detect
from mixprec.numerics.compare import Trajectory
from mixprec.numerics.fix import MapSpace, Trials, search_keep_fp32, search_precision_map
from mixprec.numerics.limits import LOW_PRECISION_FORMATS
from mixprec.numerics.ranges import RangeReport
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.numerics.trend import BITS_FACTOR, Outlook, Prediction, least_headroom
from mixprec.numerics.verdict import Floor, allowed_rel_loss_diff, unresolved_loss
from mixprec.policy import Candidate
from mixprec.policy.islands import is_fp32_island
from mixprec.policy.support import cures
from mixprec.status import Status

MAX_FIX_SET = 8  # the keep-fp32 search tries at most this many layers
# Half-precision updates lost across more than this share of all weights: no small set of fp32
# layers cures that (a stall concentrated in an embedding, say, is searched as usual).
WIDE_STALL = 0.5
SEARCH_STEPS = 4  # steps of each trial run of the search (the found set is verified over all)
# A fix for a predicted failure is verified past the predicted step: this much past it, at most
# this many steps.
VERIFY_MARGIN = 1.5
MAX_VERIFY_STEPS = 1000
# What an inconclusive verdict's reason starts with.
INCONCLUSIVE = "inconclusive"


def worst_layers(report: RangeReport, fmt: str, n: int = 5) -> list[dict[str, Any]]:
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
                "backward_absmax": bwd.absmax if bwd.count else None,
                "backward_headroom_bits": bwd.headroom_bits(fmt),
                "backward_underflow": bwd.underflow_fraction(fmt) if bwd.count else None,
            }
        )
    return rows


def layer_headroom(report: RangeReport) -> list[dict[str, Any]]:
    """Per layer, in execution order: headroom in bits per low-precision format, both passes (the
    backward one None where the framework records forward ranges only)."""
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


class Checker(Reference):
    """The :class:`Reference` of one workload, and each candidate's check against it: its verdict,
    evidence and advice, and the fix search."""

    def check(self, cand: Candidate, fix: bool) -> CandidateCheck:
        self.stage(cand.label)
        passed, reason, cmp, traj = self.run(cand)
        thr = self.thresholds[cand.threshold_key]
        fmt = rounding_format(cand)
        floor = self.loss_floor(cand, self.steps)  # made by run(): no new run here
        ranged = self.ranged(cand, traj, self.steps)  # a compiled candidate's ranges: its eager twin's
        seen = self.outlook(cand, ranged)
        verdict = Status.PASS if passed else Status.AT_RISK if reason.startswith("at risk") else Status.FAIL
        if not passed and reason.startswith(NEVER_RAN):
            verdict = Status.ERROR
        result = CandidateCheck(
            candidate=cand,
            verdict=verdict,
            reason=reason,
            max_rel_loss_diff=cmp.max_rel_loss_diff,
            output_sqnr_db=cmp.output_sqnr_db,
            min_grad_sqnr_db=cmp.min_grad_sqnr_db,
            median_grad_sqnr_db=cmp.median_grad_sqnr_db,
            total_grad_sqnr_db=cmp.total_grad_sqnr_db,
            skipped_steps=cmp.skipped_steps,
            scaler_warmup_skips=traj.warmup_skips,
            stalled_update_fraction=traj.stalled_update_fraction,
            allowed_rel_loss_diff=allowed_rel_loss_diff(thr, floor.rel_loss_diff),
            required_output_sqnr_db=self.floor.required(
                thr.min_output_sqnr_db, self.floor.output_sqnr_db, fmt
            ),
            required_grad_sqnr_db=self.floor.required(thr.min_grad_sqnr_db, self.floor.grad_sqnr_db, fmt),
            losses=traj.losses,
            rel_loss_diff=cmp.rel_loss_diff,
            scales=traj.scales,
            worst_grads=sorted(cmp.grad_sqnr_db.items(), key=lambda kv: kv[1])[:5],
            thresholds=asdict(thr),
            series=[s.to_dict() for s in ranged.series],
            run_headroom=least_headroom(ranged.series, range_format(cand)),
            stalls=list(traj.stalls),
            outlook=seen.to_dict(),
            train_steps=self.train_steps,
            evidence=self.evidence(cand, ranged, seen),
        )
        rfmt = range_format(cand)
        try:
            ranges = self.framework.layer_ranges(
                self.workload, cand, self.batches[0], self.device, traj.probe_scale
            )
            result.first_nonfinite_forward = ranges.first_nonfinite_forward
            result.first_nonfinite_backward = ranges.first_nonfinite_backward
            result.grad_underflow_fp16 = dict(ranges.grad_underflow_fp16)
        except Exception as exc:  # ranges are evidence; their failure must not hide the verdict
            result.fix_note = f"per-layer ranges unavailable: {type(exc).__name__}: {exc}"
        result.worst_layers = worst_layers(self.reference_ranges, rfmt)
        census = None
        if cand.spec.low_format is not None:
            try:
                census = self.framework.linear_census(
                    self.workload, cand.spec, self.batches[0], self.device, cand.keep_fp32
                )
            except Exception as exc:  # evidence, as the ranges: its failure must not hide the verdict
                result.fix_note = f"Linear census unavailable: {type(exc).__name__}: {exc}"
            else:
                untested = no_low_gemm(cand, census) if census is not None else ""
                if untested:  # a run without the format is bf16-mixed's: no verdict on the format
                    passed, verdict = False, Status.ERROR
                    result.verdict, result.reason = verdict, untested
        if not passed and verdict != Status.ERROR:
            result.suggestion = self.suggest(cand, result, rfmt)
            if result.first_nonfinite_forward and "non-finite" in reason:
                result.reason += f"; first non-finite output in {result.first_nonfinite_forward!r}"
            if fix and cand.spec.is_math_mode:
                result.fix_note = (
                    f"{cand.label} is a global fp32 math mode (no autocast): fp32 islands cannot fix it; "
                    "use fp32 or a *-mixed policy"
                )
            elif fix and (result.stalled_update_fraction or 0.0) > WIDE_STALL:
                result.fix_note = (
                    f"keep_fp32 search skipped: {result.stalled_update_fraction:.0%} of all weight updates "
                    "rounded away, too many for a few fp32 layers to cure; use the *-mixed policy"
                )
            elif fix and self.budget.expired():
                result.fix_note = f"keep_fp32 search skipped: {self.budget.why_ended()}"
            elif fix and census is not None and census.shapes:
                self.search_map(cand, result, census, seen.at_risk)
            elif fix:
                self.search_fix(cand, result, rfmt, seen.at_risk)
        if census is not None:
            result.precision_map = map_report(cand, census, result.fix_keep_bf16)
        spread = floor.rel_loss_diff
        if cmp.max_rel_loss_diff is not None and math.isfinite(cmp.max_rel_loss_diff):
            result.spread_ratio = cmp.max_rel_loss_diff / spread if spread > 0 else None
            result.randomness = against_spread(cmp.max_rel_loss_diff, spread, floor.apart)
        if result.verdict == Status.PASS and result.randomness:
            result.reason += f"; {result.randomness}"
        powerless = self.learning or unresolved_loss(traj.losses, cmp.loss_range)
        if result.verdict == Status.PASS and powerless:
            # no failure seen, but two runs that do not learn (or a loss read too coarsely to follow
            # fp32's) cannot show one: never a pass
            result.verdict = Status.INCONCLUSIVE
            result.reason = f"{INCONCLUSIVE}: {powerless} (its figures: {result.reason})"
        return result

    def evidence(self, cand: Candidate, traj: Trajectory, seen: Outlook) -> str:
        """What the verdict cannot see: a trend whose crossing lies beyond the evidence's horizon."""
        far = seen.unsure
        if far is None or seen.at_risk is not None:
            return ""
        predicted = far.describe(self.train_steps, TRAIN_STEPS_SETTING)
        return (
            f"not enough evidence: {predicted}; {len(traj.losses)} checked steps "
            f"support a crossing at most {far.horizon} steps and {BITS_FACTOR:g}x the "
            f"{max(far.gained_bits, 0.0):.1f} bits they grew away; rerun with --steps {far.steps_needed()}"
        )

    def suggest(self, cand: Candidate, result: CandidateCheck, fmt: str) -> str:
        overflow = (
            result.first_nonfinite_forward
            or result.first_nonfinite_backward
            or result.skipped_steps
            or result.verdict == Status.AT_RISK
        )
        if cand.spec.low_format is not None:
            # its rounding is the Linear GEMMs' own: the cure is fewer of them in the format
            return (
                f"keep the Linear layers {cand.spec.low_format} loses most in bf16 (check --fix searches the "
                "precision map), or use bf16-mixed"
            )
        # only what this device runs natively is advice (a CPU has no tf32, and fp16 is slow there)
        info = detect(self.device)
        if fmt == "fp16" and overflow:
            options = cures(cand.policy, "range", info, fmt)
            if options:
                return f"fp16 overflows here: try {' or '.join(options[:2])} (fp32's range)"
        elif fmt == "bf16":
            options = cures(cand.policy, "precision", info, fmt)
            if options:
                return f"bf16 loses too much precision here: try {' or '.join(options[:2])}"
        return "keep the failing layers in fp32 (keep_fp32=[...]) or use fp32"

    # ---------------------------------------------------------------- keep-fp32 search
    def search_space(self, result: CandidateCheck, fmt: str) -> list[str]:
        """What to try in fp32, most suspicious first: located non-finite layers, then the layers with
        the least headroom in this format, then those with the worst gradients."""
        names, owners = self.framework.island_names(self.workload)
        known = set(names)
        ordered: list[str] = []

        def add(name: str | None) -> None:
            if name and name in known and name not in ordered:
                ordered.append(name)

        add(result.first_nonfinite_forward)
        add(result.first_nonfinite_backward)
        for layer in self.reference_ranges.worst(len(names), fmt):
            add(layer.name)
        for pname, _ in result.worst_grads:
            add(owners.get(pname))
        return ordered

    def search_fix(self, cand: Candidate, result: CandidateCheck, fmt: str, risk: Prediction | None) -> None:
        """Grow a keep_fp32 set from the evidence until the candidate passes, then shrink it; a
        predicted overflow's layer is evidence like an observed one, and the fix is verified over a
        run long enough to pass the predicted step."""
        order = self.search_space(result, fmt)
        if risk is not None:
            order = [risk.layer, *(n for n in order if n != risk.layer)]
        search_keep_fp32(
            self.run, cand, result, order, MAX_FIX_SET, self.trials(risk), self.framework.island_kind
        )

    def search_map(
        self, cand: Candidate, result: CandidateCheck, census: Any, risk: Prediction | None
    ) -> None:
        """The precision map of a low-format candidate (fp8, mxfp8, nvfp4): the smallest set of
        Linear GEMMs kept in bf16 that passes, from the field's rules (first and last Linear, the LM
        head), the layers whose operands the format quantises worst first; verified like a
        keep_fp32 fix (past a predicted failure's step)."""
        layers = list(census.shapes)  # execution order
        _, owners = self.framework.island_names(self.workload)
        # observed evidence first (a predicted overflow's layer, the first non-finite layers, the
        # owners of the worst gradients), then the census: the worst quantised GEMMs
        suspects: list[str | None] = [risk.layer] if risk is not None else []
        suspects += [result.first_nonfinite_forward, result.first_nonfinite_backward]
        suspects += [owners.get(pname) for pname, _ in result.worst_grads]
        suspects += sorted(layers, key=lambda n: census.sqnr_db.get(n, math.inf))
        ordered = [n for n in dict.fromkeys(suspects) if n is not None and n in census.shapes]
        space = MapSpace(
            layers=layers,
            rules=field_rules(self.workload, layers, census.tied),
            suspects=ordered,
            directions=("wgrad", "dgrad", "forward") if cand.spec.block_format else (),
            present=census.directions or {},
        )
        search_precision_map(
            lambda entries, steps: self.run(cand, (), steps, entries), cand, result, space, self.trials(risk)
        )

    def trials(self, risk: Prediction | None) -> Trials:
        """A fix search's trials: as long as the check where a failure is predicted late in the run
        (a shorter trial cannot see it), else ``SEARCH_STEPS`` at most; verified over the check's
        steps, or past the predicted step (``VERIFY_MARGIN`` times it, at most ``MAX_VERIFY_STEPS``)."""
        if risk is None:
            return Trials(self.steps, min(self.steps, SEARCH_STEPS), self.budget, self.stage)
        verify = max(self.steps, min(MAX_VERIFY_STEPS, int(VERIFY_MARGIN * ((risk.step or 0) + 1))))
        return Trials(verify, self.steps, self.budget, self.stage)

    def result(self, results: list[CandidateCheck]) -> CheckResult:
        return CheckResult(
            workload=self.framework.workload_label(self.workload),
            device=self.device,
            batch_size=self.batch_size,
            steps=self.steps,
            reference_losses=self.reference.losses,
            chaos_floor_rel_loss_diff=self.floor.rel_loss_diff,
            chaos_floor_sqnr_db={"output": self.floor.output_sqnr_db, "grad": self.floor.grad_sqnr_db},
            chaos_floor_losses=self.chaos.losses,
            format_floor_losses={fmt: run.losses for fmt, run in self._apart.items() if not run.error},
            candidates=results,
            reference_layers=layer_headroom(self.reference_ranges),
            reference_note="; ".join(filter(None, [self.reference.note, self.learning])),
            learns=not self.learning,
            asked_steps=self.asked_steps,
            power=self.power,
        )


def no_low_gemm(cand: Candidate, census: Any) -> str:
    """Why a low-format candidate tested nothing of its format (no Linear it can take ran, or its
    map keeps them all in bf16), or ''."""
    fmt = cand.spec.low_format
    if not census.shapes:
        from mixprec.policy.lowformat import none_converted

        which = f"; {none_converted(cand.spec, census.refused)}" if census.refused else ""
        return (
            f"{NEVER_RAN}: no Linear of the model that {fmt} can take ran (dimensions multiples of its "
            f"block, fp32 weights){which}; the run was bf16 autocast alone"
        )
    if not any(x["low_directions"] for x in map_report(cand, census, ())["layers"]):
        return (
            f"{NEVER_RAN}: keep_bf16={list(cand.keep_bf16)} keeps every Linear {fmt} can take in bf16; "
            "the run was bf16 autocast alone"
        )
    return ""


def field_rules(workload: Any, layers: Sequence[str], tied: Sequence[str] = ()) -> list[str]:
    """The layers every low-format recipe in the field keeps in bf16 by a fixed rule (Accelerate's
    torchao backend, Megatron's ``--first-last-layers-bf16``, torchtitan's NVFP4 recipe): the first
    and the last Linear to run, and an LM head (a Linear whose weight an embedding shares: found in
    the workload's model, or named in ``tied`` where the model lives in another process, a script's)."""
    from torch import nn  # the low formats are torch's: only a torch workload gets here

    rules = [*layers[:1], *layers[-1:]]
    model = getattr(workload, "model", None)
    if model is not None:
        embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        modules = dict(model.named_modules())
        rules += [n for n in layers if id(getattr(modules.get(n), "weight", None)) in embedded]
    rules += [n for n in layers if n in tied]
    return list(dict.fromkeys(rules))


def map_report(cand: Candidate, census: Any, keep_bf16: Sequence[str]) -> dict[str, Any]:
    """The precision map's facts for the report: per Linear its GEMM shapes, operand SQNR in the
    format, the roofline's predicted speedup on the format's GPU (a prediction, labelled so), and
    the share of the step's FLOPs in the format whole-model and under the map ``keep_bf16``."""
    from mixprec.hardware.roofline import DEFAULT_GPU, estimate
    from mixprec.policy.lowformat import low_directions

    fmt = str(cand.spec.low_format)
    whole = dict(census.directions)
    entries = (*cand.keep_bf16, *keep_bf16)
    mapped = {n: low for n, runs in whole.items() if (low := low_directions(n, entries, runs))}
    layers = []
    for name, (m, k, n) in census.shapes.items():
        speed = estimate(m, k, n, fmt)
        layers.append(
            {
                "name": name,
                "m": m,
                "k": k,
                "n": n,
                "operand_sqnr_db": census.sqnr_db.get(name),
                "predicted_speedup": speed.speedup,
                "low_directions": sorted(mapped.get(name, ())),
            }
        )
    return {
        "format": fmt,
        "gpu": DEFAULT_GPU[fmt],
        "speedup_is": "a roofline prediction from the shapes (mixprec.hardware.roofline), not measured",
        "layers": layers,
        "low_share_whole": census.low_share(whole),
        "low_share_mapped": census.low_share(mapped),
        "map": [*cand.keep_bf16, *keep_bf16],
        "step_flops": census.step_flops,
        "no_gain": [x["name"] for x in layers if x["predicted_speedup"] < 1.0 and x["low_directions"]],
    }


def cured(rejected: CandidateCheck, rescued: CandidateCheck) -> str:
    """Why keeping layers in fp32 cured what rejected the candidate, in the figures both checks
    measured: the layer the rejection named, stalled updates, skipped steps, loss and SQNR."""
    added = [n for n in rescued.candidate.keep_fp32 if n not in rejected.candidate.keep_fp32]
    risk = (rejected.outlook or {}).get("at_risk") or {}
    named = risk.get("layer") or rejected.first_nonfinite_forward or rejected.first_nonfinite_backward
    changes = []
    if named and is_fp32_island(named, added):
        changes.append(f"{named!r}, which the rejection named, now computes in fp32")
    figures = (
        ("stalled updates", "stalled_update_fraction", lambda v: f"{v:.1%}"),
        ("skipped steps", "skipped_steps", str),
        ("max loss diff", "max_rel_loss_diff", lambda v: f"{v:.2%}"),
        ("gradient SQNR", "total_grad_sqnr_db", lambda v: f"{v:.1f} dB"),
    )
    for name, key, fmt in figures:
        before, after = getattr(rejected, key), getattr(rescued, key)
        if before is not None and after is not None and fmt(before) != fmt(after):
            changes.append(f"{name} {fmt(before)} -> {fmt(after)}")
    return (
        f"rescued: {rejected.label} was {rejected.verdict} ({rejected.reason}); with "
        f"{', '.join(added)} kept in fp32: {'; '.join(changes) or 'the same figures'}; {rescued.reason}"
    )


def against_spread(diff: float, spread: float, apart: str = Floor.apart) -> str:
    """A candidate's largest loss difference against fp32's own run-to-run spread on the same
    steps (two fp32 runs ``apart``): "within training randomness" where it is inside it
    (DeepSeek-V3's wording for FP8 against BF16), else how many times it."""
    if spread <= 0:
        return f"{_pct(diff)} apart; two fp32 runs do not drift apart at all here"
    of = f"fp32's own run-to-run spread of {_pct(spread)} (two runs {apart})"
    if diff <= spread:
        return f"within training randomness: {_pct(diff)} against {of}"
    return f"{diff / spread:.3g}x {of}"


def _pct(x: float) -> str:
    """A relative difference with the digits it needs: '1.3%', '0.0021%', '0%'."""
    return f"{100 * x:.2g}%" if x else "0%"
