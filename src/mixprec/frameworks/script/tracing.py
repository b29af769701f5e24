"""What a traced run of the script records for the numerics check (the agent's "trace" mode): each
step's per-layer ranges, the first step's output and gradients, the updates that rounded away under
half weights, the full ranges of the first step where asked; written with ``torch.save`` for the
parent (:func:`mixprec.frameworks.script.session.trace`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.frameworks.script.census import from_env as census_from_env
from mixprec.frameworks.script.messages import Step, TraceRecord
from mixprec.frameworks.torch.probe import in_functorch, model_output, nonfinite_buffers


class Tracer:
    """The trace-mode record of one script run, fed by the agent's hooks."""

    def __init__(self, model: nn.Module, range_format: str | None, *, compiled: bool, ranges: bool) -> None:
        from mixprec.frameworks.torch.ranges import RangeCollector, StepRecorder
        from mixprec.numerics.limits import LOW_PRECISION_FORMATS

        self.model = model
        fmt = range_format if range_format in LOW_PRECISION_FORMATS else None
        # a compiled forward runs no module hooks inside it: its ranges are not recorded
        self.recorder = None if compiled else StepRecorder(model, fmt)
        if self.recorder is not None:
            self.recorder.begin()
        self.ranges: Any = None
        if ranges:
            self.ranges = RangeCollector(model)
            self.ranges.install()
        self.first_output: torch.Tensor | None = None
        self._backward_began = False
        self.first_grads: dict[str, torch.Tensor] | None = None
        self.stall_before: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.step_scale: float | None = None  # the loss scale of this step's backward
        self.range_report: Any = None
        self.census = census_from_env(model)  # a Linear census of the first step, where the parent asks one

    def forward_output(self, output: Any) -> None:
        """The model's output in the first training step (the output SQNR's tensor): its last
        forward's before the first backward (a model in parts: the head's, not the backbone's)."""
        if self._backward_began or in_functorch():
            return
        first = model_output(output)
        # (a part that is a loss module returns a scalar: the output before it stays)
        if first is not None and (first.dim() or self.first_output is None):
            self.first_output = first.detach().float().cpu().clone()

    def backward_starts(self, scale: float | None) -> None:
        """Forwards from here on are activation-checkpoint recomputation; the gradients recorded
        are scaled by ``scale``."""
        if self.recorder is not None:
            self.recorder.backward_starts()
        if self.ranges is not None:
            self.ranges.in_backward = True
        self._backward_began = True
        if self.step_scale is None:
            self.step_scale = scale

    def before_update(self, scale: float | None, half_weights: bool) -> None:
        """The lead optimizer is about to step: the first step's gradients (unscaled) and, under
        half weights, the weights before the update (to count the updates that round away)."""
        if self.first_grads is None:
            self.first_grads = {
                n: p.grad.detach().float().cpu().clone() / (scale or 1.0)
                for n, p in self.model.named_parameters()
                if p.grad is not None
            }
        if half_weights:
            self.stall_before = [
                (p, p.detach().clone()) for p in self.model.parameters() if p.grad is not None
            ]

    def end_step(self, step: Step, scale_after: float | None) -> None:
        """The step ended: its ranges folded in, its scale and rounded-away updates on ``step``."""
        from mixprec.policy.scaler import rounded_away

        step_scale, self.step_scale = self.step_scale, None
        step.scale = scale_after
        if self.census is not None:
            census, self.census = self.census, None
            census.finish()
        if self.recorder is not None:
            self.recorder.next_step(step_scale)
        if self.ranges is not None:
            from mixprec.frameworks.torch.ranges import collected_report

            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.range_report = collected_report(self.ranges, grads, step_scale, step.loss)
            self.ranges.remove()
            self.ranges = None
        if self.stall_before is not None and not step.skipped:
            step.stall = rounded_away(self.stall_before)
        self.stall_before = None

    def fill(self, record: TraceRecord, nonfinite_at_start: set[str]) -> None:
        """What the parent reads besides the steps and the facts."""
        # an attention mask of -inf is -inf by design
        buffers = [n for n in nonfinite_buffers(self.model) if n not in nonfinite_at_start]
        series = list(self.recorder.series.values()) if self.recorder is not None else []
        record.first_output, record.first_grads = self.first_output, self.first_grads or {}
        record.series = [s.to_dict() for s in series]
        record.nonfinite_buffers, record.ranges = buffers, self.range_report
