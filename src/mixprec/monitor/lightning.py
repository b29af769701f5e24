"""The monitor as a Lightning ``Callback``: it watches ``training_step``'s loss after every
optimizer step, reads the precision plugin's GradScaler, logs its findings through
``LightningModule.log`` (so TensorBoard and W&B see them), refuses a checkpoint of non-finite
state, keeps its own state in the checkpoint and stops a run it gives up on through Lightning
(``trainer.should_stop``: the fit ends its own way, ``on_train_end`` and ``on_fit_end`` included).

    trainer = Trainer(..., callbacks=[MonitorCallback(rescue=True, findings="run/findings.jsonl")])
"""

from __future__ import annotations

import contextlib
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


class MonitorCallback(pl.Callback):
    """A :class:`~mixprec.monitor.Monitor` around a Lightning fit; ``kwargs`` are the Monitor's
    (``config``, ``findings``, and the config's fields: ``every``, ``rescue``, ...). The fp32 shadow
    calls ``training_step`` on the same batch (its logging is switched off for that call)."""

    def __init__(self, **kwargs: Any) -> None:
        for key in ("policy", "optimizer", "scaler", "loss_fn", "log_fn"):
            if key in kwargs:
                raise TypeError(f"MonitorCallback takes {key!r} from the Trainer; do not pass it.")
        self.kwargs = kwargs
        self.monitor: Monitor | None = None
        self._state: dict[str, Any] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)

        def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
            log, pl_module.log = pl_module.log, lambda *a, **k: None  # type: ignore[method-assign]
            try:
                loss = _loss_of(pl_module.training_step(batch, 0))
            finally:
                pl_module.log = log  # type: ignore[method-assign]
            if loss is None:
                raise TypeError("training_step returned no loss: the fp32 shadow has nothing to compare")
            return loss

        def log_fn(name: str, value: float) -> None:
            # outside Lightning's loop (a checkpoint after fit) there is nothing to log into
            with contextlib.suppress(MisconfigurationException):
                pl_module.log(name, value, on_step=True, on_epoch=False)

        self.monitor = Monitor(
            pl_module,
            optimizer=trainer.optimizers,
            scaler=scaler if isinstance(scaler, torch.amp.GradScaler) else None,
            loss_fn=loss_fn,
            log_fn=log_fn,
            **self.kwargs,
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

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = _loss_of(outputs)
        if self.monitor is None or loss is None:
            return
        self.monitor.record(loss, batch)
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
