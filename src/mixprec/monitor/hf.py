"""The monitor as a Hugging Face ``TrainerCallback``: it reads each step's loss from the model's own
output (a forward hook keeps the last ``outputs.loss`` and its batch), the Trainer's GradScaler
through Accelerate, turns a checkpoint of non-finite state into no checkpoint
(``control.should_save = False``, before the Trainer saves), stops a run it gives up on through
the Trainer (``control.should_training_stop``: the Trainer ends the run its own way, ``on_train_end``
included) and adds its findings to the Trainer's logs (``on_log``), so TensorBoard and W&B see them.

    trainer = Trainer(..., callbacks=[MonitorCallback(rescue=True, findings="run/findings.jsonl")])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from mixprec.monitor.core import Monitor
from mixprec.monitor.findings import CHECKPOINT_REFUSED, MonitorFinding


class MonitorCallback(TrainerCallback):
    """A :class:`~mixprec.monitor.Monitor` around ``Trainer.train``; ``kwargs`` are the Monitor's
    (``config``, ``findings``, and the config's fields: ``every``, ``rescue``, ...). The Trainer's
    GradScaler (``fp16=True`` on a GPU) is found on the optimizer Accelerate wraps
    (``AcceleratedOptimizer.scaler``)."""

    def __init__(self, **kwargs: Any) -> None:
        for key in ("policy", "optimizer", "loss_fn", "log_fn"):
            if key in kwargs:
                raise TypeError(f"MonitorCallback takes {key!r} from the Trainer; do not pass it.")
        self.kwargs = kwargs
        self.monitor: Monitor | None = None
        self._last: tuple[torch.Tensor, Any] | None = None
        self._handle: Any = None
        self._logged = 0

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any
    ) -> None:
        if model is None:
            return

        def keep_loss(module: nn.Module, inputs: tuple, kwargs: dict, output: Any) -> None:
            loss = getattr(output, "loss", None)
            if isinstance(loss, torch.Tensor) and module.training:
                self._last = (loss, kwargs)

        self._handle = model.register_forward_hook(keep_loss, with_kwargs=True)
        optimizer = kw.get("optimizer")
        scaler = getattr(optimizer, "scaler", None)
        kwargs = dict(self.kwargs)
        if isinstance(scaler, torch.amp.GradScaler) and kwargs.get("scaler") is None:
            kwargs["scaler"] = scaler
        self.monitor = Monitor(model, optimizer=optimizer, loss_fn=lambda m, batch: m(**batch).loss, **kwargs)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.monitor is None or self._last is None:
            return
        loss, batch = self._last
        self._last = None
        self.monitor.record(loss, batch)
        if self.monitor.stopped:
            control.should_training_stop = True
        if control.should_save and self.monitor.checkpoint_refusal() is not None:
            control.should_save = False  # (recorded as a finding) the Trainer goes on without it

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
        if self.monitor is None or logs is None:
            return
        for finding in self.monitor.findings[self._logged :]:
            logs[f"mixprec/{finding.kind}"] = finding.step
        self._logged = len(self.monitor.findings)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
        if self.monitor is not None:
            self.monitor.close()

    @property
    def refused(self) -> list[MonitorFinding]:
        return [f for f in (self.monitor.findings if self.monitor else []) if f.kind == CHECKPOINT_REFUSED]
