"""The script's step as a program the monitor can run again: from the model's first forward of the
step to its ``backward()``, the model's calls (with the inputs the script passed) and the torch calls
that turn their outputs into the loss (the script's loss head: ``F.cross_entropy(out.view(-1, V),
y.view(-1))``, a label-smoothing term, a mask). Replayed from the same weights in strict fp32 and in
the policy, it is what the monitor's shadow compares (is a spike the batch's, the precision's or a
transient?) for a script, as ``loss_fn(model, batch)`` is for a :class:`~mixprec.Workload`.

Recording is a ``TorchFunctionMode``, active only between a model call's end and the next model call
or ``backward()``: the forward itself runs untouched. A tensor made inside the tape is a *slot* (held
by a weak reference while recording, recomputed in a replay); any other tensor (the targets, a mask
made before the forward) is kept as the script had it. What the tape cannot follow (Python arithmetic
on a value read with ``item()``, NumPy) is kept as recorded: a replay is exact for the same batch,
which is what the shadow replays. A tape whose replay does not give back the step's own loss, from
the same weights and random state, is not used (the monitor checks it once:
:func:`mixprec.monitor.script.replays_its_step`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Slot:
    """A tensor made inside the tape: the ``index``-th."""

    index: int


class StepTape(TorchFunctionMode):
    """One step of the script, recorded (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.program: list[tuple[str, Any, Any, Any, Any]] = []  # (kind, func, args, kwargs, out)
        self.losses: list[Slot] = []  # what the script called backward() on, unscaled
        self.rng: tuple[torch.Tensor, list[torch.Tensor] | None] = _rng_state()
        self.broken = ""  # why this tape cannot be replayed ('' while it can)
        self._slots: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (the tensor, its slot)
        self._made = 0  # slots made so far
        self._recording = False

    # ------------------------------------------------------------------ the agent's events
    def model_call(self, part: str, args: tuple, kwargs: dict) -> None:
        """The model (``part`` '') or one of its parts (a backbone, a head) is called (its pre-hook):
        recording pauses through its forward."""
        self.pause()
        self.program.append(("model", part, self._template(args), self._template(kwargs), None))

    def model_output(self, output: Any) -> None:
        """Its output: each tensor in it a slot, then recording resumes."""
        if not self.program or self.program[-1][0] != "model" or self.program[-1][4] is not None:
            self.broken = self.broken or "a model call the tape did not see begin"
            return
        kind, func, args, kwargs, _ = self.program[-1]
        self.program[-1] = (kind, func, args, kwargs, self._outputs(output))
        self.resume()

    def backward(self, losses: list[torch.Tensor]) -> None:
        """``backward()`` on ``losses`` (unscaled): recording pauses; each must be a slot."""
        self.pause()
        for loss in losses:
            slot = self._slot_of(loss)
            if slot is None:
                self.broken = self.broken or "the loss is not computed from the model's output"
            else:
                self.losses.append(slot)

    def resume(self) -> None:
        if not self._recording and not self.broken:
            self.__enter__()
            self._recording = True

    def pause(self) -> None:
        if not self._recording:
            return
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or stack[-1] is not self:  # the script pushed a mode of its own meanwhile
            self.broken = self.broken or "the script runs a torch function mode of its own"
            return
        self.__exit__(None, None, None)
        self._recording = False

    # ------------------------------------------------------------------ recording
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.broken or torch.compiler.is_compiling():
            return result
        try:
            targs, tkwargs = self._template(args), self._template(kwargs)
            if _has_slot((targs, tkwargs)):  # (an op on the targets alone keeps its result as made)
                self.program.append(("op", func, targs, tkwargs, self._outputs(result)))
        except Exception as exc:  # recording must never break the script's step
            self.broken = f"{type(exc).__name__} while recording"
        return result

    def _slot_of(self, t: torch.Tensor) -> Slot | None:
        ref = self._slots.get(id(t))
        return Slot(ref[1]) if ref is not None and ref[0]() is t else None

    def _new_slot(self, t: torch.Tensor) -> Slot:
        slot = Slot(self._made)
        self._made += 1
        self._slots[id(t)] = (weakref.ref(t), slot.index)
        return slot

    def _template(self, value: Any) -> Any:
        """``value`` with each slot tensor replaced by its :class:`Slot` (others kept as they are)."""
        if isinstance(value, torch.Tensor):
            return self._slot_of(value) or value
        if isinstance(value, (list, tuple)):
            items = [self._template(v) for v in value]
            return type(value)(items) if type(value) in (list, tuple) else items
        if isinstance(value, dict):
            return {k: self._template(v) for k, v in value.items()}
        return value

    def _outputs(self, value: Any) -> Any:
        """``value`` with each tensor in it made a new slot (a model's output, an op's result)."""
        if isinstance(value, torch.Tensor):
            return self._new_slot(value)
        if isinstance(value, (list, tuple)):
            return [self._outputs(v) for v in value]
        if isinstance(value, dict):  # (a ModelOutput is a dict)
            return {k: self._outputs(v) for k, v in value.items()}
        return None

    # ------------------------------------------------------------------ replaying
    def replay(self, model: nn.Module) -> torch.Tensor:
        """The step's loss again, computed from ``model`` as it is now (under whatever precision
        context the caller has entered), from the step's own random state."""
        if self.broken:
            raise RuntimeError(f"the step cannot be replayed: {self.broken}")
        _set_rng(self.rng)
        values: dict[int, torch.Tensor] = {}
        for kind, func, args, kwargs, out in self.program:
            a, k = _fill(args, values), _fill(kwargs, values)
            result = model.get_submodule(func)(*a, **k) if kind == "model" else func(*a, **k)
            _assign(out, result, values)
        if not self.losses:
            raise RuntimeError("the step called no backward() the tape saw")
        return torch.stack([values[s.index].float().reshape(()) for s in self.losses]).sum()


def _has_slot(value: Any) -> bool:
    if isinstance(value, Slot):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_slot(v) for v in value)
    if isinstance(value, dict):
        return any(_has_slot(v) for v in value.values())
    return False


def _fill(template: Any, values: dict[int, torch.Tensor]) -> Any:
    if isinstance(template, Slot):
        return values[template.index]
    if isinstance(template, (list, tuple)):
        items = [_fill(v, values) for v in template]
        return type(template)(items) if type(template) in (list, tuple) else items
    if isinstance(template, dict):
        return {k: _fill(v, values) for k, v in template.items()}
    return template


def _assign(template: Any, result: Any, values: dict[int, torch.Tensor]) -> None:
    if isinstance(template, Slot):
        values[template.index] = result
    elif isinstance(template, list):
        items = list(result.values()) if isinstance(result, dict) else list(result)
        for t, r in zip(template, items, strict=False):
            _assign(t, r, values)
    elif isinstance(template, dict):
        for key, t in template.items():
            _assign(t, result[key] if isinstance(result, dict) else getattr(result, key), values)


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None


def _set_rng(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
