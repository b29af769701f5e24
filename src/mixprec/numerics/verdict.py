"""Judging a candidate against strict fp32: the thresholds, the chaos floor and the verdict.

The chaos floor is an fp32 run whose initial weights differ by one part in 2^20: how far two
fp32 runs drift apart on this model in the same steps. The loss allowance and the SQNR floors
adapt to it (calibration and figures in docs/check.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mixprec.numerics.compare import Comparison, Trajectory
from mixprec.policy import POLICIES, Thresholds

# Formats run as an emulated fp32 policy (`check --emulate`): their limits, calibrated like the
# policies' own (docs/check.md). fp8 loses more than bf16; the floors are guards against garbage.
EMULATED_THRESHOLDS: dict[str, Thresholds] = {
    "emulated:tf32": Thresholds(1e-2, 15.0, 10.0),
    "emulated:bf16": Thresholds(2e-2, 5.0, 3.0),
    "emulated:fp8_e4m3": Thresholds(1e-1, 3.0, 0.0),
    "emulated:fp8_e5m2": Thresholds(1e-1, 0.0, -3.0),
}


def default_thresholds() -> dict[str, Thresholds]:
    """Every policy's thresholds (from its spec) and the emulated formats', by threshold key."""
    return {**{name: spec.thresholds for name, spec in POLICIES.items()}, **EMULATED_THRESHOLDS}


CHAOS_PERTURBATION = 2.0**-20
# The loss allowance of a half format (bf16, fp16, tf32) also takes an fp32 run whose weights are
# off by the format's own rounding (its unit roundoff): a 2^-20 run can still be short of saturation
# where one of bf16's size already is, so the tiny floor alone failed healthy bf16 on a chaotic model
# (ResNet-50 from scratch, 6 steps: bf16-mixed 10.2% apart, fp32 runs 2^-20 apart 2.1%, runs a bf16
# rounding apart saturated with it). Coarser formats (fp8, fp4) round the weights into another model,
# not randomness: they keep the 2^-20 floor and their own limits.
COARSEST_RANDOMNESS_EPS = 2.0**-7  # bf16's machine epsilon
# SQNR of that perturbation itself: 20*log10(1 / 2^-20).
_CHAOS_INPUT_SQNR_DB = 20 * math.log10(1 / CHAOS_PERTURBATION)
# How much worse than the format's rounding, propagated like the chaos perturbation, a
# candidate may be: rounding hits every layer's inputs, not the weights once (~10*log10(depth)).
SQNR_MARGIN_DB = 20.0
# At or below this SQNR the error is at least as large as the signal: the layer computes noise.
NOISE_DB = 0.0
# The largest loss difference a candidate may show as a fraction of the range strict fp32's loss
# covered over the checked steps (or three times two fp32 runs' drift there). A guard, offset-free:
# the relative difference divides by the loss's level, which a constant in the loss inflates
# (+1000 turned a 76% difference into 0.87%); healthy formats stay under 2% of the range on the MLP
# and the zoo GPT, bf16-true's lagging updates at 35% on the GPT, a format that computes noise far past it.
MAX_LOSS_DIFF_OF_RANGE = 0.5


# A candidate whose loss is computed in a half format reads it on that format's grid: each reading is
# off by up to half a spacing at the loss's level. Where fp32's loss moved less than this many
# spacings over the checked steps, the losses cannot show whether the candidate followed it. The
# nanoGPT on random tokens (AMX Xeon): bf16-true's losses 11.0, 10.9375, 10.875, ... (bf16's grid,
# 0.0625 apart at 10.9) against fp32's 10.881 -> 10.854, a fail at "431% of the 0.0276 that fp32's
# loss moved", its first step (the same weights, before any update) 0.119 off already.
RESOLVED_SPACINGS = 4.0


def loss_grid(losses: list[float]) -> tuple[str, float] | None:
    """The half format every finite loss of a run lies on exactly (it computed its loss there), and
    that format's spacing at the largest loss; None for a loss read in fp32 (six fp32 readings all
    on bf16's grid by chance: about one in 2^96)."""
    import torch

    from mixprec.numerics.limits import FORMATS

    finite = [v for v in losses if math.isfinite(v)]
    top = max((abs(v) for v in finite), default=0.0)
    if len(finite) < 2 or top == 0.0:
        return None
    read = torch.tensor(finite, dtype=torch.float64)
    for fmt, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if torch.equal(read.to(dtype).to(torch.float64), read):
            return fmt, 2.0 ** (math.floor(math.log2(top)) - FORMATS[fmt].mantissa_bits)
    return None


def unresolved_loss(losses: list[float], moved: float | None) -> str:
    """Why a run's losses cannot be judged against the ``moved`` that fp32's loss covered ('' where
    they can): read on a half format's grid coarser than the movement (:data:`RESOLVED_SPACINGS`)."""
    grid = loss_grid(losses)
    if grid is None or moved is None or not math.isfinite(moved):
        return ""
    fmt, spacing = grid
    if moved >= RESOLVED_SPACINGS * spacing:
        return ""
    return (
        f"its loss is computed in {fmt}, whose readings are {spacing:.3g} apart at its level: fp32's loss "
        f"moved {moved:.3g} over the checked steps, under {RESOLVED_SPACINGS:g} of those steps, so the "
        "losses cannot tell whether it follows fp32"
    )


def format_perturbation(fmt: str) -> float | None:
    """The weight perturbation of one rounding to ``fmt`` (its unit roundoff, eps/2), for the formats
    whose rounding is training randomness; None for fp32 and formats coarser than bf16."""
    from mixprec.numerics.limits import FORMATS

    limits = FORMATS.get(fmt)
    if limits is None or fmt == "fp32" or limits.eps > COARSEST_RANDOMNESS_EPS:
        return None
    return limits.eps / 2


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
    # what the two runs behind ``rel_loss_diff`` differ by, in the verdict's words
    apart: str = "whose weights differ by 2^-20"

    def required(self, absolute: float, floor_sqnr: float | None, fmt: str) -> float:
        """The SQNR floor for a candidate in ``fmt``: the absolute guard, lowered on models that
        amplify noise so much that even the format's own rounding could not reach it. At or below
        0 dB the error is as large as the signal (noise): the floor reaches it only on a model whose
        own amplification (the chaos run's) turns the format's rounding into noise, never through the
        margin a coarse format leaves (NVFP4's rounding is 17 dB, less than the 20 dB margin)."""
        if floor_sqnr is None or not math.isfinite(floor_sqnr):
            return max(absolute, NOISE_DB)
        amplified = rounding_sqnr_db(fmt) - (_CHAOS_INPUT_SQNR_DB - floor_sqnr)
        lowered = min(absolute, amplified - SQNR_MARGIN_DB)
        return lowered if amplified <= NOISE_DB else max(lowered, NOISE_DB)


def below(sqnr: float, required: float) -> bool:
    """Whether an SQNR misses its floor: under it, or at or below 0 dB where the floor is not under
    0 dB (noise is never a pass on a model that does not make the format's rounding noise)."""
    return sqnr < required or (required >= NOISE_DB and sqnr <= NOISE_DB)


def allowed_rel_loss_diff(thr: Thresholds, floor: float) -> float:
    return max(thr.max_rel_loss_diff, thr.chaos_factor * floor)


def judge(
    cmp: Comparison,
    traj: Trajectory,
    thr: Thresholds,
    steps: int,
    floor: Floor,
    fmt: str,
    losses_have_power: bool = True,
) -> tuple[bool, str]:
    """(passed, reason). The reason names the first criterion that failed, with the figure.
    Without ``losses_have_power`` (the fp32 reference did not learn) the loss difference as a share
    of the range fp32's loss moved is not judged (a reference that does not move has no range), and
    nothing passes on the losses: the caller makes a pass inconclusive. The failures that need no
    learning to show still fail: a crash, non-finite values, skipped or stalled updates, outputs or
    gradients that compute noise, and a loss further from fp32's than the chaos floor allows."""
    if traj.dropped_imaginary:  # first: it explains a crash that follows
        crash = f"; then training crashed: {traj.error}" if traj.error else ""
        return False, (
            "complex values were cast to real (torch: "
            f"{traj.dropped_imaginary.split(' (Triggered')[0].strip()!r}): the candidate computes "
            f"another model; keep the complex modules in fp32 or use a *-mixed policy{crash}"
        )
    if traj.error:
        return False, f"training crashed: {traj.error}"
    if traj.nonfinite_buffers:
        names = ", ".join(traj.nonfinite_buffers[:4]) + (" ..." if len(traj.nonfinite_buffers) > 4 else "")
        return False, (
            f"buffers became non-finite while training ({names}): the model is broken for evaluation "
            "(BatchNorm running statistics past a half-precision format's range, say)"
        )
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
            f"{floor.apart} drift {floor.rel_loss_diff:.2%} apart here)"
        )
    moved = cmp.loss_diff_of_range
    readable = not unresolved_loss(traj.losses, cmp.loss_range)
    if losses_have_power and readable and moved is not None and cmp.loss_range:
        # two fp32 runs' drift on this scale, at most (the relative floor times fp32's largest loss)
        chaos = floor.rel_loss_diff * cmp.loss_level / cmp.loss_range
        limit = max(MAX_LOSS_DIFF_OF_RANGE, thr.chaos_factor * chaos)
        if moved > limit:
            return False, (
                f"loss differs from fp32 by {cmp.max_loss_diff:.3g}, {moved:.0%} of the {cmp.loss_range:.3g} "
                f"that fp32's loss moved over the checked steps (allowed {limit:.0%}); relative to the loss "
                f"itself only {cmp.max_rel_loss_diff:.2%}: its level (a constant in it) hides the difference"
            )
    need_out = floor.required(thr.min_output_sqnr_db, floor.output_sqnr_db, fmt)
    if cmp.output_sqnr_db is not None and below(cmp.output_sqnr_db, need_out):
        return False, _sqnr_failure("output", cmp.output_sqnr_db, need_out)
    need_grad = floor.required(thr.min_grad_sqnr_db, floor.grad_sqnr_db, fmt)
    if cmp.total_grad_sqnr_db is not None and below(cmp.total_grad_sqnr_db, need_grad):
        return False, _sqnr_failure("gradient", cmp.total_grad_sqnr_db, need_grad)
    margin = []
    if cmp.output_sqnr_db is not None:
        margin.append(f"output SQNR {cmp.output_sqnr_db:.1f} dB ({_bar(need_out)})")
    if cmp.total_grad_sqnr_db is not None:
        margin.append(f"gradient SQNR {cmp.total_grad_sqnr_db:.1f} dB ({_bar(need_grad)})")
    margin.append(f"max loss diff {cmp.max_rel_loss_diff:.2%} (<= {allowed:.2%})")
    return True, "matches fp32: " + ", ".join(margin)


def _sqnr_failure(what: str, sqnr: float, required: float) -> str:
    if sqnr <= NOISE_DB <= required:
        return (
            f"{what} SQNR {sqnr:.1f} dB: at or below 0 dB the error is as large as the signal (noise), "
            "and this model does not amplify the format's rounding that far"
        )
    return f"{what} SQNR {sqnr:.1f} dB < {required:.1f} dB required"


def _bar(required: float) -> str:
    return f"> {required:.1f}" if required == NOISE_DB else f">= {required:.1f}"
