"""Faults to rehearse the monitor with: a NaN, an inf or a spike put into a given step's loss,
gradient or activation, at given steps or at a known rate, as Megatron-LM's ``RerunErrorInjector``
does for its rerun machine.

A fault is **persistent** (every computation of that step shows it, a replay of the batch
included: what a bad batch or a precision fault looks like) or **transient** (only the first
computation of the step: what a flipped bit or a flaky kernel looks like; a replay is clean). Public
so a user can rehearse their own loop, framework and monitor settings before a long run::

    faults = FaultInjector(model, where="activation", module="head", steps={150}, transient=True)
    faults.attach(optimizer)           # counts the steps (or: clock=lambda: trainer.global_step)
    loss_fn = faults.loss_fn(loss_fn)  # where="loss" only: the wrapped loss function
    ...
    faults.injected                    # the steps a fault went in, for the test to compare with
    faults.close()

The step is the number of optimizer steps taken so far (:meth:`FaultInjector.attach` counts them
with the optimizer's post-step hook), a ``clock`` the framework already keeps (Lightning's
``trainer.global_step``, the HF Trainer's ``state.global_step``), or :attr:`FaultInjector.step` set
by the loop itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from mixprec.errors import UsageError

FAULTS = ("spike", "nan", "inf")
"""What goes in: the value times ``factor``, NaN, or +inf."""
WHERE = ("activation", "gradient", "loss")
"""Where it goes: a module's output, a module's parameter gradients, or the loss."""

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _corrupt(t: torch.Tensor, fault: str, factor: float) -> torch.Tensor:
    """``t`` with the fault in it, keeping its autograd graph (a backward still runs through it)."""
    if fault == "spike":
        return t * factor
    return t + (float("nan") if fault == "nan" else float("inf"))


class FaultInjector:
    """Puts a fault into the steps it is armed at.

    Args:
        model: the model being trained.
        fault: one of :data:`FAULTS`.
        where: one of :data:`WHERE`.
        module: the module (``model.get_submodule`` name) whose output (``activation``) or output
            gradient (``gradient``: its parameters' gradients and every one before it follow) takes
            the fault; '' (default) is the model itself.
        steps: the steps to put it in.
        rate: besides ``steps``, the share of the other steps armed at random (decided once per
            step from ``seed``, so the same steps every run: the rate is known).
        factor: a spike multiplies by it.
        transient: only the first computation of an armed step takes the fault (a replay of the
            batch is clean); False: every one does (a replay shows it again).
        seed: for ``rate``.
        clock: returns the current step (a framework's own counter); None: :attr:`step`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        fault: str = "spike",
        where: str = "activation",
        module: str = "",
        steps: Collection[int] = (),
        rate: float = 0.0,
        factor: float = 1e3,
        transient: bool = False,
        seed: int = 0,
        clock: Callable[[], int] | None = None,
    ) -> None:
        if fault not in FAULTS:
            raise UsageError(f"fault must be one of {', '.join(FAULTS)}, got {fault!r}.")
        if where not in WHERE:
            raise UsageError(f"where must be one of {', '.join(WHERE)}, got {where!r}.")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise UsageError(f"rate must be a number in [0, 1] (the share of steps armed), got {rate!r}.")
        if where == "loss" and module:
            raise UsageError("where='loss' takes no module: wrap the loss with faults.loss_fn(loss_fn).")
        try:
            target = model.get_submodule(module)
        except AttributeError:
            names = [n for n, _ in model.named_modules() if n]
            raise UsageError(
                f"module {module!r} is not in the model; valid: '' (the model), {', '.join(names[:12])}"
                f"{' ...' if len(names) > 12 else ''}."
            ) from None
        self.model, self.fault, self.where, self.factor = model, fault, where, float(factor)
        self.steps, self.rate, self.seed = set(steps), float(rate), seed
        self.transient, self.clock = transient, clock
        self.step = 0
        """The current step where there is no ``clock`` (:meth:`attach` counts optimizer steps)."""
        self.injected: list[int] = []
        """The steps a fault went in (each once, however many computations took it)."""
        self._hits: dict[int, int] = {}  # step: computations that took the fault
        self._handles: list[Any] = []
        if where == "activation":
            self._handles.append(target.register_forward_hook(self._on_output))
        elif where == "gradient":  # the gradient into the module's output: its parameters' and before
            self._handles.append(target.register_full_backward_pre_hook(self._on_grad_output))

    # ------------------------------------------------------------------ when
    def now(self) -> int:
        return self.clock() if self.clock is not None else self.step

    def armed(self, step: int) -> bool:
        """Whether ``step`` takes the fault (one of ``steps``, or drawn at ``rate``)."""
        if step in self.steps:
            return True
        return self.rate > 0 and random.Random(self.seed * 1_000_003 + step).random() < self.rate

    def _take(self) -> bool:
        """Whether this computation (a forward, a backward, a loss) takes the fault."""
        step = self.now()
        if not self.armed(step):
            return False
        hits = self._hits.get(step, 0)
        if self.transient and hits:
            return False  # a transient fault: the first computation only, a replay is clean
        self._hits[step] = hits + 1
        if not hits:
            self.injected.append(step)
        return True

    # ------------------------------------------------------------------ where
    def _on_output(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or not self._take():
            return None
        return _corrupt(output, self.fault, self.factor)

    def _on_grad_output(self, module: nn.Module, grad_output: tuple[torch.Tensor | None, ...]) -> Any:
        if not self._take():
            return None
        return tuple(g if g is None else _corrupt(g, self.fault, self.factor) for g in grad_output)

    def loss_fn(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` with the fault in its loss at the armed steps (``where='loss'``)."""
        if self.where != "loss":
            raise UsageError(
                f"loss_fn() wraps the loss for where='loss'; this injector is where={self.where!r}."
            )

        def faulty(model: nn.Module, batch: Any) -> torch.Tensor:
            loss = loss_fn(model, batch)
            return _corrupt(loss, self.fault, self.factor) if self._take() else loss

        return faulty

    # ------------------------------------------------------------------ the clock and the end
    def attach(self, optimizer: torch.optim.Optimizer) -> FaultInjector:
        """Count the steps by ``optimizer``'s steps (a step skipped by a GradScaler is not one)."""

        def tick(*_: Any) -> None:
            self.step += 1

        self._handles.append(optimizer.register_step_post_hook(tick))
        return self

    def close(self) -> None:
        """Remove every hook: the model computes as before."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> FaultInjector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
