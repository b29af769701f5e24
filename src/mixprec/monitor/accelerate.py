"""The monitor in an Accelerate loop: built from the Accelerator (its GradScaler under fp16, the
unwrapped model and optimizer), with a ``save_state`` pre-hook that refuses a checkpoint of
non-finite state before Accelerate writes it.

    monitor = watch(accelerator, model, optimizer, loss_fn=loss_fn, rescue=True)
    for batch in loader:
        loss = loss_fn(model, batch)
        accelerator.backward(loss)
        optimizer.step(); optimizer.zero_grad()
        monitor.observe(loss, batch)  # a plain loop: raises MonitorStop when the run must stop
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from mixprec.monitor.core import Monitor


def watch(accelerator: Accelerator, model: nn.Module, optimizer: Any, **kwargs: Any) -> Monitor:
    """A :class:`Monitor` for the prepared ``model`` and ``optimizer`` of ``accelerator``;
    ``kwargs`` are the Monitor's (``loss_fn``, ``config``, ``findings``, ``every``, ``rescue``, ...)."""
    for key in ("policy", "scaler", "optimizer"):
        if key in kwargs:
            raise TypeError(f"watch() takes {key!r} from the Accelerator; do not pass it.")
    scaler = accelerator.scaler if isinstance(accelerator.scaler, torch.amp.GradScaler) else None
    monitor = Monitor(accelerator.unwrap_model(model), optimizer=optimizer, scaler=scaler, **kwargs)
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: monitor.check_checkpoint())
    return monitor
