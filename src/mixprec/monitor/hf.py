"""The monitor as a Hugging Face ``TrainerCallback``: it reads each step's loss from the model's own
output (a forward hook keeps the last ``outputs.loss`` and its batch), the Trainer's GradScaler
through Accelerate, turns a checkpoint of non-finite state into no checkpoint
(``control.should_save = False``, before the Trainer saves), stops a run it gives up on through
the Trainer (``control.should_training_stop``: the Trainer ends the run its own way, ``on_train_end``
included) and adds its findings to the Trainer's logs (``on_log``), so TensorBoard and W&B see them.

Before each optimizer step (``on_pre_optimizer_step``) it hands the step's loss and micro-batches to
the monitor, so a spike is diagnosed from the same weights before the update lands: replayed in the
Trainer's precision (the model's forward, which Accelerate wraps in its autocast) and in strict fp32
(the unwrapped forward); a data spike's update is withheld inside the optimizer step, the Trainer
told its step was skipped (``AcceleratedOptimizer.step_was_skipped``, what a GradScaler's overflow
sets) so it skips the scheduler's step too, and the batch (the step) written to
``skip_batches.json`` in ``output_dir``.

    trainer = Trainer(..., callbacks=[MonitorCallback(rescue=True, findings="run/findings.jsonl")])
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from mixprec.monitor.core import Monitor
from mixprec.monitor.findings import CHECKPOINT_REFUSED, MonitorFinding


def _loss(model: nn.Module, batches: list[dict[str, Any]]) -> torch.Tensor:
    """The mean loss of a step's micro-batches, as the model computes it (the monitor's fp32 shadow
    runs the forward Accelerate's autocast wrapper keeps, ``_original_forward``)."""
    losses = [model(**b).loss for b in batches]
    return losses[0] if len(losses) == 1 else torch.stack(losses).mean()


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
        self._step: list[tuple[torch.Tensor, Any]] = []  # this step's micro-batches: (loss, inputs)
        self._replaying = False  # the monitor's own forwards are not the Trainer's
        self._handle: Any = None
        self._logged = 0
        self._skipped: Any = None  # the optimizer told its step was skipped

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any
    ) -> None:
        if model is None:
            return

        def keep_loss(module: nn.Module, inputs: tuple, kwargs: dict, output: Any) -> None:
            loss = getattr(output, "loss", None)
            if isinstance(loss, torch.Tensor) and module.training and not self._replaying:
                self._step.append((loss, kwargs))

        def loss_fn(m: nn.Module, batches: list[dict[str, Any]]) -> torch.Tensor:
            self._replaying = True
            try:
                return _loss(m, batches)
            finally:
                self._replaying = False

        self._handle = model.register_forward_hook(keep_loss, with_kwargs=True)
        optimizer = kw.get("optimizer")
        scaler = getattr(optimizer, "scaler", None)
        kwargs = dict(self.kwargs)
        if isinstance(scaler, torch.amp.GradScaler) and kwargs.get("scaler") is None:
            kwargs["scaler"] = scaler
        kwargs.setdefault("skip_list", os.path.join(args.output_dir, "skip_batches.json"))
        self.monitor = Monitor(model, optimizer=optimizer, loss_fn=loss_fn, **kwargs)

    def _loss_and_batches(self) -> tuple[torch.Tensor, list[dict[str, Any]]] | None:
        if not self._step:
            return None
        losses = [loss for loss, _ in self._step]
        loss = losses[0] if len(losses) == 1 else torch.stack([v.detach() for v in losses]).mean()
        return loss, [b for _, b in self._step]

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        step = self._loss_and_batches()
        if self.monitor is not None and step is not None:
            self.monitor.before_step(step[0], step[1], batch_index=state.global_step)

    def on_optimizer_step(
        self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any
    ) -> None:
        monitor = self.monitor
        if monitor is None or not monitor.withheld or monitor.withheld[-1] != monitor.step:
            return
        if hasattr(optimizer, "_is_overflow"):  # Accelerate's flag for a step its GradScaler skipped:
            optimizer._is_overflow = True  # the Trainer then leaves the scheduler's step out too
            self._skipped = optimizer

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._skipped is not None:
            self._skipped._is_overflow = False  # (without a GradScaler nobody else resets it)
            self._skipped = None
        step = self._loss_and_batches()
        self._step = []
        if self.monitor is None or step is None:
            return
        self.monitor.record(*step)
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
