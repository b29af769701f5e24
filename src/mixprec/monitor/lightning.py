"""The monitor as a Lightning ``Callback``: it watches ``training_step``'s loss after every
optimizer step, reads the precision plugin's GradScaler, logs its findings through
``LightningModule.log`` (so TensorBoard and W&B see them), refuses a checkpoint of non-finite
state, keeps its own state in the checkpoint and stops a run it gives up on through Lightning
(``trainer.should_stop``: the fit ends its own way, ``on_train_end`` and ``on_fit_end`` included).

A spike is checked in ``on_before_optimizer_step`` (after Lightning's backward, its GradScaler's
unscale included, and before the optimizer applies the update: Lightning runs the backward inside
``optimizer.step``'s closure, so the optimizer's own pre-step hook would come too early): its batch
is replayed in ``training_step`` under the precision plugin's own context and in strict fp32; a data
spike's update is withheld inside that optimizer step and its ``batch_idx`` written to
``skip_batches.json`` in ``default_root_dir``, the form of Lightning's own ``SpikeDetection``.

A step is an optimizer step: with ``accumulate_grad_batches`` its loss is the mean of its
micro-batches' and a replay runs every one of them. Under manual optimization
(``automatic_optimization = False``) the monitor never steps an optimizer: training_step steps them
itself, so a replay of it ends at its first ``manual_backward`` (the loss is all a replay needs).

    trainer = Trainer(..., callbacks=[MonitorCallback(rescue=True, findings="run/findings.jsonl")])
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision
from torch import nn

from mixprec.monitor.core import Monitor


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None


def _mean(losses: list[torch.Tensor]) -> torch.Tensor:
    return losses[0] if len(losses) == 1 else torch.stack(losses).mean()


class _Backward(Exception):
    """Ends a replay of a manual-optimization ``training_step`` at its ``manual_backward``, the loss
    in hand: what follows it (the optimizers' steps, the schedulers') must not run again."""

    def __init__(self, loss: torch.Tensor) -> None:
        super().__init__("the replay ends at manual_backward")
        self.loss = loss


def _stop_at_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    raise _Backward(loss)


@contextlib.contextmanager
def _patched(obj: Any, **attrs: Any) -> Iterator[None]:
    """``obj``'s attributes replaced for the body, as they were after it."""
    before = {name: vars(obj)[name] for name in attrs if name in vars(obj)}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name in attrs:
            if name in before:
                setattr(obj, name, before[name])
            else:
                delattr(obj, name)


def replay_loss(pl_module: pl.LightningModule, batches: list[tuple[Any, int]]) -> torch.Tensor:
    """The mean loss of ``training_step`` over a step's micro-batches ``(batch, batch_idx)``, its
    logging off. Under manual optimization each call ends at its first ``manual_backward`` (the
    optimizer steps after it would apply an update the monitor is judging), and what it toggled
    (``requires_grad``, ``toggle_optimizer``) is as it was after."""
    manual = not pl_module.automatic_optimization
    flags = [(p, p.requires_grad) for p in pl_module.parameters()]
    silence = {"log": lambda *a, **k: None}
    if manual:
        silence["manual_backward"] = _stop_at_backward
    losses = []
    try:
        with _patched(pl_module, **silence):
            for batch, batch_idx in batches:
                losses.append(_replayed(pl_module, batch, batch_idx, manual))
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    return _mean(losses)


def _replayed(pl_module: pl.LightningModule, batch: Any, batch_idx: int, manual: bool) -> torch.Tensor:
    try:
        loss = _loss_of(pl_module.training_step(batch, batch_idx))
    except _Backward as ended:
        return ended.loss
    if manual:
        raise TypeError(
            "training_step called no manual_backward: under manual optimization its replay ends there, "
            "and without one the fp32 shadow has nothing to compare"
        )
    if loss is None:
        raise TypeError("training_step returned no loss: the fp32 shadow has nothing to compare")
    return loss


class MonitorCallback(pl.Callback):
    """A :class:`~mixprec.monitor.Monitor` around a Lightning fit; ``kwargs`` are the Monitor's
    (``config``, ``findings``, and the config's fields: ``every``, ``rescue``, ...). The fp32 shadow
    calls ``training_step`` on the same batches (its logging switched off; under manual optimization
    up to its ``manual_backward``: :func:`replay_loss`)."""

    def __init__(self, **kwargs: Any) -> None:
        for key in ("policy", "optimizer", "scaler", "loss_fn", "log_fn"):
            if key in kwargs:
                raise TypeError(f"MonitorCallback takes {key!r} from the Trainer; do not pass it.")
        self.kwargs = kwargs
        self.monitor: Monitor | None = None
        self._state: dict[str, Any] | None = None
        # the step so far: its micro-batches (batch, batch_idx), their losses as they went into the
        # backward, and whether an optimizer stepped (the end of an accumulation)
        self._batches: list[tuple[Any, int]] = []
        self._losses: list[torch.Tensor] = []
        self._stepped = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)

        def loss_fn(module: nn.Module, batches: list[tuple[Any, int]]) -> torch.Tensor:
            return replay_loss(pl_module, batches)

        def log_fn(name: str, value: float) -> None:
            # outside Lightning's loop (a checkpoint after fit) there is nothing to log into
            with contextlib.suppress(MisconfigurationException):
                pl_module.log(name, value, on_step=True, on_epoch=False)

        kwargs = dict(self.kwargs)
        kwargs.setdefault("skip_list", os.path.join(trainer.default_root_dir, "skip_batches.json"))
        self.monitor = Monitor(
            pl_module,
            optimizer=trainer.optimizers,
            scaler=scaler if isinstance(scaler, torch.amp.GradScaler) else None,
            loss_fn=loss_fn,
            log_fn=log_fn,
            # a replay in the run's precision: the plugin's own context, which Lightning enters
            # around training_step (a callback's call of it runs outside)
            autocast=lambda: trainer.strategy.precision_plugin.train_step_context(),
            **kwargs,
        )
        self.monitor.when_widened(lambda: self._to_mixed(trainer))
        if self._state is not None:
            self.monitor.load_state_dict(self._state)

    def _to_mixed(self, trainer: pl.Trainer) -> str:
        """After the monitor widened a *-true model to fp32: Lightning's half precision plugin (it
        casts the inputs and sets the half default dtype) gives way to its *-mixed twin."""
        plugin = trainer.strategy.precision_plugin
        if not isinstance(plugin, HalfPrecision):
            return ""
        mixed: Literal["bf16-mixed", "16-mixed"] = (
            "bf16-mixed" if plugin.precision == "bf16-true" else "16-mixed"
        )
        device = trainer.strategy.root_device.type
        scaler = torch.amp.GradScaler(device) if mixed == "16-mixed" else None
        trainer.strategy.precision_plugin = MixedPrecision(mixed, device, scaler=scaler)
        if self.monitor is not None and scaler is not None:
            self.monitor.scaler = scaler
        return f"Lightning's precision plugin {plugin.precision} replaced by {mixed}"

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batches.append((batch, batch_idx))

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # training_step's loss: Lightning hands this hook the one its backward takes, divided by the
        # accumulation and multiplied by its GradScaler's scale (a tensor: no sync to undo it)
        loss, n = loss.detach(), trainer.accumulate_grad_batches
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() and scaler._scale is not None:
            loss = loss / scaler._scale
        self._losses.append(loss if n == 1 else loss * n)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """After the backward, before the update: hand the step over and check it (a withheld
        update: the optimizer is handed no gradient inside its step, they are back after it)."""
        self._stepped = True
        if self.monitor is None or not self._losses or not self._batches:
            return
        batch_index = self._batches[-1][1]
        self.monitor.before_step(_mean(self._losses), list(self._batches), batch_index=batch_index)
        self.monitor.check_update(optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._stepped:
            return  # a micro-batch that stepped no optimizer: the step ends with the one that does
        returned = _loss_of(outputs)  # (a manual training_step whose backward was not manual_backward)
        losses = self._losses or ([returned.detach()] if returned is not None else [])
        batches = self._batches
        self._batches, self._losses, self._stepped = [], [], False
        if self.monitor is None or not losses:
            return
        self.monitor.record(_mean(losses), batches)
        if self.monitor.stopped:
            trainer.should_stop = True  # Lightning ends the fit after this batch, its hooks called

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        if self.monitor is not None:
            # raising is the one way to stop Lightning's save before it writes anything
            self.monitor.check_checkpoint()
            checkpoint["mixprec_monitor"] = self.monitor.state_dict()

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        self._state = checkpoint.get("mixprec_monitor")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()
