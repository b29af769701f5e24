"""Which candidates tune compiles: chosen by what compiling can gain, not by how fast they ran eager.

The eager ranking does not predict the compiled one (on a small GPT on a 2-core CPU, bf16 autocast
gained 40% from compiling, bf16 weights 2%), so every precision family that did not fail its check
gets a compiled variant when the budget allows, ordered by a prediction from where its profiled eager
step spends its time:

- compiling the model fuses the elementwise work around the matmuls and convolutions (the share
  outside matmul/conv/attention and outside the optimizer) and removes about ``FUSION_GAIN`` of it;
- compiling the whole step fuses the optimizer's update too (``OPTIMIZER_GAIN`` of its share),
  except under a loss scaler, whose step dynamo leaves eager;
- the compile time is paid once, spread over the run (``train_steps``).

The prediction only orders the attempts and names what the budget skipped; every compiled
candidate is measured, and each measurement recalibrates the prediction for the rest
(:meth:`Calibration.update`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from mixprec.frameworks import Framework
from mixprec.measure.results import BenchRow
from mixprec.policy import Candidate
from mixprec.tuning.speedups import speed

# Share of the elementwise time compiling removes (a prior: 65-80% measured on a small GPT, 2-core CPU).
FUSION_GAIN = 0.7
OPTIMIZER_GAIN = 0.6  # share of the eager optimizer step a compiled step removes (a prior)
UNPROFILED_ELEMENTWISE = 0.3  # the elementwise share assumed where no profile was taken
# What a compile is assumed to cost before one was timed (ResNet-50 and a small GPT took 15-45 s
# each on a 2-core CPU, a whole step up to half as long again).
MIN_COMPILE_S = 20.0
# More graph breaks than this and a compiled candidate's row says so: none for a compiled model;
# a compiled step breaks at backward() (twice in dynamo's count) and at optimizer.zero_grad, and
# the loss scaler's calls break it again.
GRAPH_BREAKS_NOTED = 0
STEP_GRAPH_BREAKS = 8


@dataclass(frozen=True)
class Attempt:
    """One compiled candidate tune may measure, with why.

    Attributes:
        candidate: the compiled candidate (the family's fastest eager layout, compiled).
        eager: the eager row it comes from.
        gain: the predicted share of the eager step time compiling removes.
        speedup: the predicted speedup over strict fp32 per step.
        basis: where the prediction comes from, in words.
    """

    candidate: Candidate
    eager: BenchRow
    gain: float
    speedup: float
    basis: str


@dataclass
class Calibration:
    """Measured over predicted gain per scope, updated after each compiled measurement: a machine
    where compiling the model does not pay (seen on a 2-core CPU) stops predicting that it does."""

    factor: dict[str | None, float] = field(default_factory=dict)

    def of(self, scope: str | None) -> float:
        return self.factor.get(scope, 1.0)

    def update(self, attempt: Attempt, measured: BenchRow) -> None:
        eager, compiled = speed(attempt.eager), speed(measured)
        if not eager or not compiled or attempt.gain <= 0:
            return
        realized = 1 - eager / compiled  # the share of the eager step time compiling removed
        scope = attempt.candidate.compile_scope
        # attempt.gain is already calibrated: scale the factor it was predicted with
        self.factor[scope] = self.of(scope) * max(0.0, realized) / attempt.gain


def predicted_gain(row: BenchRow, scope: str | None, loss_scaled: bool) -> tuple[float, str]:
    """The share of ``row``'s eager step time compiling at ``scope`` should remove, and the basis."""
    optimizer = row.optimizer_share or 0.0
    if row.compute_share is None:
        elementwise, basis = UNPROFILED_ELEMENTWISE, "no profile: a typical elementwise share"
    else:
        elementwise = max(0.0, 1.0 - row.compute_share - optimizer)
        basis = f"{elementwise:.0%} of its step outside matmul/conv/attention and the optimizer"
    gain = FUSION_GAIN * elementwise
    if scope == "step":
        if loss_scaled:
            basis += "; the loss scaler's step stays eager"
        elif optimizer:
            gain += OPTIMIZER_GAIN * optimizer
            basis += f", {optimizer:.0%} in the optimizer"
    return min(gain, 0.9), basis


def families(rows: Sequence[BenchRow], failed: set[Candidate]) -> list[BenchRow]:
    """The fastest eager row of each precision family (policy and fp32 islands) that ran and did
    not fail its check (``failed`` holds ``Candidate.numerics``): one not checked yet may still win
    once compiled (bf16 autocast gained more from compiling than bf16 weights), and its compiled
    variant is checked on its own."""
    best: dict[tuple[str, tuple[str, ...]], BenchRow] = {}
    for row in rows:
        c = row.candidate
        if c.compile or c.optimizer or row.baseline_repeat or row.status != "ok" or not speed(row):
            continue
        if c.numerics in failed:
            continue
        key = (c.policy, c.keep_fp32)
        if key not in best or speed(row) > speed(best[key]):
            best[key] = row
    return list(best.values())


def plan(
    framework: Framework,
    rows: Sequence[BenchRow],
    failed: set[Candidate],
    modes: Sequence[str],
    calibration: Calibration,
) -> list[Attempt]:
    """Every compiled variant worth measuring, most promising first: for each passing family its
    best scope first (so each family gets one before any gets a second), then the rest. No step
    scope for a candidate that accumulates micro-batches (every export refuses it, and dynamo does
    not compile it whole)."""
    scopes: list[str | None] = [None, *[s for s in framework.compile_scopes if s != "model"]]
    firsts, seconds = [], []
    for row in families(rows, failed):
        if row.candidate.as_written:
            continue  # the script's own precision: what mixprec changes is not part of it
        attempts = []
        for mode in modes:
            for scope in scopes:
                if scope == "step" and row.candidate.accumulation_steps > 1:
                    # a step over accumulated micro-batches loops over backward(): dynamo skips the
                    # whole function (graph break in a loop), so it would not be a compiled step
                    continue
                gain, basis = predicted_gain(row, scope, row.candidate.spec.loss_scaling)
                gain *= calibration.of(scope)
                cand = replace(row.candidate, compile=mode, compile_scope=scope)
                attempts.append(Attempt(cand, row, gain, speed(row) / (1 - gain), basis))
        attempts.sort(key=lambda a: a.speedup, reverse=True)
        firsts.append(attempts[0])
        seconds += attempts[1:]
    return sorted(firsts, key=lambda a: a.speedup, reverse=True) + sorted(
        seconds, key=lambda a: a.speedup, reverse=True
    )


def graph_note(row: BenchRow) -> str | None:
    """What to say when a compiled candidate breaks into more graphs than its scope needs: each
    break stops fusion across it (a compiled step breaks at backward() and zero_grad by design)."""
    step = row.candidate.compile_scope == "step"
    if not row.graph_breaks or row.graph_breaks <= (STEP_GRAPH_BREAKS if step else GRAPH_BREAKS_NOTED):
        return None
    return (
        f"{row.label}: the {'step' if step else 'model'} compiles into {row.graphs} graphs with "
        f"{row.graph_breaks} graph breaks; each one splits the compiled graph and stops fusion across it "
        "(torch._dynamo.explain(fn)(batch) lists where and why)"
    )
