"""The script's copies of its model.

Scripts copy their model: ``AveragedModel(model)`` and timm's ``ModelEmaV3`` (an EMA),
``copy.deepcopy(model)`` (a best-so-far snapshot, a teacher), ``torch.save(model)`` (the whole
module pickled). What the agent sets on the model stays behind in a copy: a bound method of the
agent as a forward hook made every one of them fail (deepcopy copied the agent through it: "cannot
pickle 'generator' object"), and a compiled forward set on the model (a function holding the
original's bound forward) made a deep copy compute with the original's weights. Here, a copy gets
an inert hook and its own eager forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class OwnHook:
    """A forward (pre-)hook of the agent's on ``model``: ``call`` runs for the model alone. A deep
    copy of the model shares this object, on which it is inert (the copy is not the model: its
    forwards are no training samples); a pickled model holds an inert one."""

    def __init__(self, call: Callable[..., Any] | None, model: nn.Module | None) -> None:
        self.call, self.model = call, model

    def __call__(self, module: nn.Module, *rest: Any) -> Any:
        if self.call is None or module is not self.model:
            return None
        return self.call(module, *rest)

    def __deepcopy__(self, memo: dict) -> OwnHook:
        return self

    def __reduce__(self) -> tuple:
        return (OwnHook, (None, None))


class CompiledForward:
    """``model.forward`` compiled (a compile candidate) so that the agent's hooks on the model stay
    eager. A deep copy of the model runs its own forward, eager; a pickled model, its class's."""

    def __init__(self, forward: Callable[..., Any], mode: str | None) -> None:
        self.eager = forward
        self.compiled = torch.compile(forward, mode=mode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self.eager, memo)  # (a bound method: bound to the copy, in memo)

    def __reduce__(self) -> str | tuple[Any, ...]:
        return self.eager.__reduce__()
