"""The monitor in an Accelerate loop: built from the Accelerator (its GradScaler under fp16, the
unwrapped model and optimizer), with a ``save_state`` pre-hook that refuses a checkpoint of
non-finite state before Accelerate writes it.

    monitor = watch(accelerator, model, optimizer, loss_fn=loss_fn, rescue=True)
    for batch in loader:
        loss = loss_fn(model, batch)
        accelerator.backward(loss)
        monitor.before_step(loss, batch)  # a spike is diagnosed (and withheld) before its update
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        monitor.observe(loss, batch)  # a plain loop: raises MonitorStop when the run must stop

With gradient accumulation (the same body inside ``with accelerator.accumulate(model):``) every
iteration is observed all the same: each micro-batch is a step to the monitor, and the stalled share
of half weights is counted at the optimizer's own updates only (a micro-batch that does not step it
moves nothing, and nothing stalled).

An update the monitor withheld is a skipped step to Accelerate (``optimizer.step_was_skipped``, what
its GradScaler's overflow sets), so a prepared scheduler leaves its step out too.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from mixprec.monitor.core import Monitor
from mixprec.monitor.gate import unwrapped


def watch(accelerator: Accelerator, model: nn.Module, optimizer: Any, **kwargs: Any) -> Monitor:
    """A :class:`Monitor` for the prepared ``model`` and ``optimizer`` of ``accelerator``;
    ``kwargs`` are the Monitor's (``loss_fn``, ``config``, ``findings``, ``every``, ``rescue``, ...)."""
    for key in ("policy", "scaler", "optimizer"):
        if key in kwargs:
            raise TypeError(f"watch() takes {key!r} from the Accelerator; do not pass it.")
    scaler = accelerator.scaler if isinstance(accelerator.scaler, torch.amp.GradScaler) else None
    monitor = Monitor(accelerator.unwrap_model(model), optimizer=optimizer, scaler=scaler, **kwargs)
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: monitor.check_checkpoint())
    if hasattr(optimizer, "_is_overflow"):
        monitor._hooks.append(unwrapped(optimizer).register_step_post_hook(_skip_flag(monitor, optimizer)))
    return monitor


def _skip_flag(monitor: Monitor, wrapper: Any) -> Any:
    """A post-step hook telling Accelerate's optimizer whether its step was skipped: a withheld
    update is (with a GradScaler, Accelerate concludes so itself when the step it patched is not
    seen as called; without one, the flag is set here and cleared at the next step)."""

    def hook(*_: Any) -> None:
        if monitor.withheld and monitor.withheld[-1] == monitor.step:
            wrapper._is_overflow = True
            wrapper._accelerate_step_called = False
        elif getattr(wrapper, "scaler", None) is None:
            wrapper._is_overflow = False

    return hook
