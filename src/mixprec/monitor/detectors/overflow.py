"""A step that overflowed the policy's format (``overflow``) and a loss scale that keeps falling
(``scale_collapse``), with the module that produced the first non-finite value.

Seen three ways: a skipped step below the scale the run settled at (GradScaler's own rhythm is
not news: its start-up search, the back-off after a growth, and a single skip the next step does
not repeat); a non-finite loss the host holds on a step that was not skipped; a non-finite loss
read at a sampled step. Rescued by an fp32 island for the module (a collapse: bf16-mixed where the
device has it).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch

from mixprec.monitor.detectors.base import (
    NONFINITE,
    SCALER_SKIPPED_NONFINITE,
    Detector,
    Run,
    SampleView,
    StepView,
)
from mixprec.monitor.findings import OVERFLOW, SCALE_COLLAPSE, MonitorFinding
from mixprec.monitor.judge import culprit
from mixprec.monitor.rescue import module_of
from mixprec.monitor.shadow import first_nonfinite

log = logging.getLogger("mixprec.monitor")

# A skip that drops the scale this many halvings below the level the run settled at, in a row of
# skips, is a collapse (GradScaler's own floor, min_scale, would stop the run a few skips later).
COLLAPSE_HALVINGS = 6


def locate(run: Run, batch: Any, scale: float | None) -> str | None:
    """The first module whose output or gradient is non-finite on ``batch`` under the policy (a
    plain loop: fp16 autocast); without the batch, the policy's last non-finite gradient."""
    if batch is not None and run.loss_fn is not None:
        device = next(run.model.parameters()).device.type
        autocast: contextlib.AbstractContextManager[Any] = (
            run.policy.autocast() if run.policy else torch.autocast(device, dtype=torch.float16)
        )
        try:
            return first_nonfinite(run.model, run.loss_fn, batch, autocast, scale)
        except Exception as exc:  # evidence only: its failure must not stop the run
            log.debug("locating the overflow failed: %s", exc)
    names = run.policy.stats.last_nonfinite_params if run.policy is not None else []
    return module_of(names[-1]) if names else None  # the last parameter: nearest the output


class Overflow(Detector):
    """Overflows and collapses, after the detectors that blame the weights or the batch."""

    kinds = (OVERFLOW, SCALE_COLLAPSE)

    def on_suspect(self, run: Run, view: StepView) -> bool:
        if view.suspect == SCALER_SKIPPED_NONFINITE:
            return False  # fp32 was finite (the batch detector said nothing): the scaler's own skip
        if view.suspect == NONFINITE:
            # a non-finite loss the scaler did not skip (no scaler, or a finite gradient), whose fp32
            # shadow (the bad-batch detector's) was finite
            module = locate(run, view.batch, run.scale.current)
            where = f"first non-finite in {module!r}" if module else "module not located"
            message = f"the loss is {view.loss} under the policy, finite in fp32 ({where})"
            run.report(
                MonitorFinding(view.step, OVERFLOW, message, module), run.rescuer.action("island", module)
            )
            return True
        return self._skip(run, view)

    def _skip(self, run: Run, view: StepView) -> bool:
        if run.scale.unscaled():
            return self._unscaled_skip(run, view)
        scale, settled = run.scale.current, run.scale.settled
        assert scale is not None and settled is not None  # (a loss scaler's SKIP suspect has both)
        halvings = math.log2(settled / scale)
        if view.step - 1 not in run.scale.skipped[-2:] and halvings < COLLAPSE_HALVINGS:
            # one skip the next step does not repeat: the scaler backed off to fit gradients that
            # grew (its job; a timm ViT in fp16 did so three times in 2,000 steps). An overflow the
            # precision causes persists at any scale: it skips again, and that is the finding.
            return False
        module = locate(run, view.batch, scale * 2)
        evidence = {"scale": scale, "settled_scale": settled}
        if halvings >= COLLAPSE_HALVINGS:
            message = (
                f"the loss scale fell {halvings:.0f} halvings, to {scale:g}: gradients overflow at any "
                "scale" + (f" (first non-finite in {module!r})" if module else "")
            )
            finding = MonitorFinding(view.step, SCALE_COLLAPSE, message, module, evidence)
            run.report(finding, run.rescuer.action("to_bf16"), per_module=False)
            return True
        where = f"first non-finite in {module!r}" if module else "module not located"
        message = (
            f"the step overflowed the policy's format ({where}); the loss scale fell to {scale:g}, "
            f"{halvings:.0f} halvings below the level it had settled at"
        )
        finding = MonitorFinding(view.step, OVERFLOW, message, module, evidence)
        run.report(finding, run.rescuer.action("island", module))
        return True

    def _unscaled_skip(self, run: Run, view: StepView) -> bool:
        """A finite check's skip (no loss scaler) the bad-batch detector did not put on the data:
        no scaler backs off and retries, so one is the finding."""
        module = locate(run, view.batch, None)
        where = f"first non-finite in {module!r}" if module else "module not located"
        shadow = ", finite in fp32" if view.batch is not None and run.loss_fn is not None else ""
        message = (
            f"the step's gradients were not finite under the policy{shadow} ({where}); the finite "
            "check skipped it"
        )
        run.report(MonitorFinding(view.step, OVERFLOW, message, module), run.rescuer.action("island", module))
        return True

    def on_sample(self, run: Run, view: SampleView) -> bool:
        if view.explained:
            return False
        at = view.first_nonfinite()
        if at is None:
            return False
        module, where = culprit(view.series, run.range_format)
        finding = MonitorFinding(
            view.step,
            OVERFLOW,
            f"the loss is not finite since step {at} ({where})",
            module,
            {"first_nonfinite_loss_step": at},
        )
        run.report(finding, run.rescuer.action("island", module))
        return True
