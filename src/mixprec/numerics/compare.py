"""Differential training: a candidate's :class:`Trajectory` against a strict-fp32 reference's.

Both runs start from the same weights and see the same batches (each framework backend records
its trajectory: ``Framework.trajectory``). Per step: the loss, its relative difference to the
reference, skipped steps and the loss scale; at the first step the SQNR of the model output and
of every parameter gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mixprec.numerics.trend import LayerSeries


def sqnr_db(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB: 20*log10(||ref|| / ||ref - x||); inf when equal."""
    # complex tensors (spectral filters) are compared whole: .double() would drop the imaginary part
    wide = torch.complex128 if reference.is_complex() or candidate.is_complex() else torch.float64
    ref = reference.detach().to(wide)
    noise = (ref - candidate.detach().to(wide)).norm()
    signal = ref.norm()
    if not torch.isfinite(noise):
        return -math.inf
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return float(20 * torch.log10(signal / noise))


@dataclass
class Trajectory:
    """What one run recorded: the per-step losses of training and the first-step probe."""

    label: str
    losses: list[float] = field(default_factory=list)
    stepped: list[bool] = field(default_factory=list)
    scales: list[float | None] = field(default_factory=list)
    first_output: torch.Tensor | None = None
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    probe_scale: float | None = None  # loss scale the first-step probe needed (fp16)
    warmup_skips: int = 0  # steps GradScaler would skip to back off from its init scale to probe_scale
    stall_counts: list[int] = field(default_factory=lambda: [0, 0])  # (stalled, with gradient), *-true
    # per step: the stalled fraction of that step's updates (*-true), the layers' ranges
    stalls: list[float] = field(default_factory=list)
    series: list[LayerSeries] = field(default_factory=list)
    # what the run did that no comparison of losses shows (each one fails the candidate)
    observed_dtype: str | None = None  # what the first matmul/conv layer computed in
    observed_layer: str | None = None
    nonfinite_buffers: list[str] = field(default_factory=list)  # e.g. BatchNorm running stats
    dropped_imaginary: str | None = None  # complex values cast to real somewhere in the step
    note: str = ""  # what a reader of the comparison must know about how this run was recorded

    @property
    def stalled_update_fraction(self) -> float | None:
        """Of the weights that had a gradient, the fraction whose update rounded away (*-true only)."""
        stalled, total = self.stall_counts
        return stalled / total if total else None

    error: str | None = None


@dataclass
class Comparison:
    """A candidate trajectory measured against the reference."""

    rel_loss_diff: list[float]
    max_rel_loss_diff: float
    output_sqnr_db: float | None
    grad_sqnr_db: dict[str, float]
    total_grad_sqnr_db: float | None  # all parameter gradients as one vector
    min_grad_sqnr_db: float | None
    median_grad_sqnr_db: float | None
    skipped_steps: int
    nonfinite_loss_step: int | None
    # The loss difference apart from the loss's level: a constant added to the loss (a regulariser's
    # offset, a +1000) dilutes |loss - loss_fp32| / |loss_fp32| but changes none of these.
    max_loss_diff: float = 0.0  # the largest |loss - loss_fp32|
    loss_range: float | None = None  # how far fp32's loss moved over the steps (max - min); None: < 4 steps
    loss_level: float = 0.0  # the largest |loss_fp32|: what the relative difference divides by

    @property
    def loss_diff_of_range(self) -> float | None:
        """The largest loss difference as a fraction of the range fp32's loss covered (offset-free)."""
        return self.max_loss_diff / self.loss_range if self.loss_range else None


# Fewer steps than this: fp32's loss range says too little about the loss's scale.
MIN_RANGE_STEPS = 4


def compare(reference: Trajectory, candidate: Trajectory) -> Comparison:
    rel, diffs = [], []
    nonfinite_at = None
    for i, (r, c) in enumerate(zip(reference.losses, candidate.losses, strict=False)):
        if not math.isfinite(c):
            nonfinite_at = i if nonfinite_at is None else nonfinite_at
            rel.append(math.inf)
            diffs.append(math.inf)
        else:
            rel.append(abs(c - r) / max(abs(r), 1e-12))
            diffs.append(abs(c - r))
    ref = [r for r in reference.losses[: len(rel)] if math.isfinite(r)]
    loss_range = max(ref) - min(ref) if len(ref) >= MIN_RANGE_STEPS else None
    out_sqnr = None
    ref_out, cand_out = reference.first_output, candidate.first_output
    if ref_out is not None and cand_out is not None and ref_out.shape == cand_out.shape:
        out_sqnr = sqnr_db(ref_out, cand_out)
    grads = {
        name: sqnr_db(g, candidate.first_grads[name])
        for name, g in reference.first_grads.items()
        if name in candidate.first_grads and g.norm() > 0
    }
    values = sorted(grads.values())
    common = [n for n in reference.first_grads if n in candidate.first_grads]
    total = None
    if common:
        total = sqnr_db(
            torch.cat([reference.first_grads[n].flatten() for n in common]),
            torch.cat([candidate.first_grads[n].flatten() for n in common]),
        )
    return Comparison(
        rel_loss_diff=rel,
        max_rel_loss_diff=max(rel) if rel else math.inf,
        output_sqnr_db=out_sqnr,
        grad_sqnr_db=grads,
        total_grad_sqnr_db=total,
        min_grad_sqnr_db=values[0] if values else None,
        median_grad_sqnr_db=values[len(values) // 2] if values else None,
        skipped_steps=sum(1 for s in candidate.stepped if not s),
        nonfinite_loss_step=nonfinite_at,
        max_loss_diff=max(diffs, default=0.0),
        loss_range=loss_range or None,
        loss_level=max((abs(r) for r in ref), default=0.0),
    )
