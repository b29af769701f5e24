"""The monitor as a Hugging Face ``TrainerCallback``: it reads each step's loss from the model's own
output as the Trainer does (a forward hook keeps the loss of a ``ModelOutput`` or a dict, or a
tuple's first element, and its batch; where the Trainer computes the loss elsewhere, a
``compute_loss_func`` or label smoothing, it warns once that it sees no step), the Trainer's
GradScaler through Accelerate, turns a checkpoint of non-finite state into no checkpoint
(``control.should_save = False``, before the Trainer saves, whether or not it sees the loss), stops
a run it gives up on through the Trainer (``control.should_training_stop``: the Trainer ends the run
its own way, ``on_train_end`` included) and logs its findings through ``Trainer.log`` as
``mixprec/<kind>`` (the step), so ``log_history`` holds them and every callback's ``on_log`` sees
them: TensorBoard's and W&B's too.

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

import inspect
import os
import warnings
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from mixprec.monitor.core import Monitor
from mixprec.monitor.findings import CHECKPOINT_REFUSED, MonitorFinding

NO_LOSS = (
    "mixprec MonitorCallback: the model's training forward returned no loss it can read (a "
    "ModelOutput or dict with 'loss', or a tuple whose first element is the loss: where the Trainer "
    "computes the loss itself, with compute_loss_func, label smoothing or its own compute_loss, the "
    "model returns none), so the monitor sees no step: no spike, overflow, stall or poisoned weights "
    "is found. A checkpoint of non-finite weights is still refused."
)


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a model's output, read as the Trainer's ``compute_loss`` reads it: ``["loss"]``
    of a ``ModelOutput`` or a plain dict, else the first element of a tuple; None where there is no
    one-element tensor there (a model called without labels returns its logits first)."""
    if isinstance(output, dict):  # (a ModelOutput is an OrderedDict, holding the fields that are set)
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = None
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _loss(model: nn.Module, batches: list[dict[str, Any]]) -> torch.Tensor:
    """The mean loss of a step's micro-batches, as the model computes it (the monitor's fp32 shadow
    runs the forward Accelerate's autocast wrapper keeps, ``_original_forward``)."""
    losses = []
    for batch in batches:
        loss = _loss_of(model(**batch))
        if loss is None:
            raise TypeError("the model returned no loss on a replay: the fp32 shadow has nothing to compare")
        losses.append(loss)
    return losses[0] if len(losses) == 1 else torch.stack(losses).mean()


def _calling_trainer() -> Trainer | None:
    """The Trainer whose training loop runs the hook calling this (a few frames up: the Trainer, its
    CallbackHandler, the hook). The Trainer hands its callbacks no reference to itself, and its
    ``log`` is the one way into its ``log_history`` and every callback's ``on_log``: the report_to
    callbacks (TensorBoard, W&B) come before a user's, so adding to ``logs`` in ``on_log`` is too late
    for them."""
    frame = inspect.currentframe()
    try:
        for _ in range(8):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            caller = frame.f_locals.get("self")
            if isinstance(caller, Trainer):
                return caller
        return None
    finally:
        del frame  # (a frame held here would keep the whole stack alive)


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
        self._logged = 0  # the findings already in the Trainer's logs
        self._trainer: Trainer | None = None  # whose log() takes them
        self._warned = False  # that no loss can be read
        self._skipped: Any = None  # the optimizer told its step was skipped

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any
    ) -> None:
        if model is None:
            return
        self._trainer = _calling_trainer()

        def keep_loss(module: nn.Module, inputs: tuple, kwargs: dict, output: Any) -> None:
            if not module.training or self._replaying:
                return
            loss = _loss_of(output)
            if loss is not None:
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
        if self.monitor is None:
            return
        if step is not None:
            self.monitor.record(*step)
            if self.monitor.stopped:
                control.should_training_stop = True
        elif not self._warned:
            self._warned = True
            warnings.warn(NO_LOSS, UserWarning, stacklevel=2)
        self._guard(control)
        self._log_findings()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # save_strategy="epoch": the Trainer saves after this hook, not after on_step_end's
        self._guard(control)
        self._log_findings()

    def _guard(self, control: Any) -> None:
        """No checkpoint of non-finite state: the save the Trainer is about to make is called off
        (recorded as a finding; the Trainer goes on without it), whether or not a loss was seen."""
        if self.monitor is not None and control.should_save and self.monitor.checkpoint_refusal() is not None:
            control.should_save = False

    def _log_findings(self) -> None:
        """The findings since the last call into the Trainer's logs, one ``mixprec/<kind>`` entry
        (its step) each: ``Trainer.log`` adds them to ``log_history`` and hands them to every
        callback's ``on_log``."""
        if self.monitor is None or self._trainer is None:
            return
        new = self.monitor.findings[self._logged :]
        self._logged = len(self.monitor.findings)
        if new:
            self._trainer.log({f"mixprec/{f.kind}": float(f.step) for f in new})

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
        """Where no Trainer was found to log through: the findings join the Trainer's own next logs
        (its ``log_history`` entry too; the callbacks before this one have seen them already)."""
        if self.monitor is None or logs is None or self._trainer is not None:
            return
        entries = {f"mixprec/{f.kind}": float(f.step) for f in self.monitor.findings[self._logged :]}
        self._logged = len(self.monitor.findings)
        logs.update(entries)
        if state.log_history:
            state.log_history[-1].update(entries)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
        if self.monitor is not None:
            self.monitor.close()

    @property
    def refused(self) -> list[MonitorFinding]:
        return [f for f in (self.monitor.findings if self.monitor else []) if f.kind == CHECKPOINT_REFUSED]
