"""What a script's own ``GradScaler`` did to one optimizer this step, read from its private state.

``torch.amp.GradScaler`` says whether it skipped a step only inside ``step()`` (which returns None
either way) and keeps its per-optimizer stage (``UNSCALED`` after ``unscale_``) private. The agent
needs both: a skipped step is the script's own, and gradients already unscaled must not be divided
again. The layout read here (``_per_optimizer_states[id(optimizer)]`` with ``found_inf_per_device``
and an ``OptState`` ``stage``) is torch's from 2.4 to 2.14; on a torch outside that range it is read
only where it still has that shape, and a warning says skipped steps of the script's own scaler may
go unseen.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

# torch releases whose GradScaler state this module was checked against (first, last)
CHECKED_TORCH = ((2, 4), (2, 14))


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Lightning's, Accelerate's)."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def found_inf(scaler: Any, optimizer: Any) -> bool:
    """Whether ``scaler`` found inf/NaN in ``optimizer``'s gradients this step (it skips the step)."""
    found = _state(scaler, optimizer).get("found_inf_per_device") or {}
    return any(float(v) > 0 for v in found.values())


def unscaled(scaler: Any, optimizer: Any) -> bool:
    """Whether ``optimizer``'s gradients were unscaled by ``scaler`` since its last update."""
    stage = _state(scaler, optimizer).get("stage")
    return getattr(stage, "name", "") == "UNSCALED"


def _state(scaler: Any, optimizer: Any) -> dict[str, Any]:
    _warn_if_unchecked()
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return {}
    state = states.get(id(torch_optimizer(optimizer)))
    return state if isinstance(state, dict) else {}


@functools.cache
def _warn_if_unchecked() -> None:
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    first, last = CHECKED_TORCH
    if not first <= version <= last:
        warnings.warn(
            f"mixprec reads torch.amp.GradScaler's private per-optimizer state, checked on torch "
            f"{first[0]}.{first[1]} to {last[0]}.{last[1]}; on torch {torch.__version__} a step the "
            "script's own GradScaler skips may go unseen",
            RuntimeWarning,
            stacklevel=3,
        )
