"""An optimizer's implementation (``Candidate.optimizer``) as torch.optim's constructors select it:
one table shared by the workload's session (an optimizer rebuilt with it), tune's variants of its
pick, and the script agent (the script's optimizers built with it).

torch.optim documents ``foreach=`` (multi-tensor kernels) and ``fused=`` (one kernel per step, on CPU
and CUDA for Adam, AdamW, SGD and Adagrad) on each optimizer that has them; neither is a Python loop
over the parameters. A fused optimizer must be built so: its constructor also sets
``_step_supports_amp_scaling`` (GradScaler then hands it the inf check), which no flag set later does.
"""

from __future__ import annotations

import inspect
from typing import Any

from mixprec.errors import UnsupportedError

# The keywords each implementation of mixprec.policy.candidate.OPTIMIZER_IMPLS passes; the ones a
# class does not take are left out (a class with foreach= only is for-loop or foreach).
KEYWORDS: dict[str, dict[str, bool]] = {
    "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False},
    "fused": {"fused": True, "foreach": False},
}
# What tune tries on its pick: the kernels, where the class has them (the for-loop is never faster).
TUNED: tuple[str, ...] = ("foreach", "fused")


def accepted(cls: type) -> set[str]:
    """The implementation keywords ``cls``'s constructor takes."""
    init = next(vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k))  # (cls.__init__)
    return set(inspect.signature(init).parameters) & {"foreach", "fused"}


def keywords(cls: type, implementation: str) -> dict[str, bool]:
    """The constructor keywords of ``cls`` that select ``implementation``. Raises
    :class:`UnsupportedError` when the class has no such implementation (it takes no keyword that
    turns it on)."""
    flags = KEYWORDS[implementation]
    takes = accepted(cls)
    wanted = [k for k, on in flags.items() if on]
    if any(k not in takes for k in wanted):
        raise UnsupportedError(
            f"{cls.__name__} has no {implementation} implementation (it takes no {wanted[0]}= argument)"
        )
    return {k: v for k, v in flags.items() if k in takes}


def offered(cls: type) -> list[str]:
    """The implementations of :data:`TUNED` that ``cls`` offers."""
    takes = accepted(cls)
    return [impl for impl in TUNED if impl in takes]


def named(flags: dict[str, Any]) -> str | None:
    """The implementation ``foreach=`` / ``fused=`` values select (None: neither said, torch's default
    for the device: foreach on CUDA, the for-loop elsewhere)."""
    if flags.get("fused"):
        return "fused"
    if flags.get("foreach"):
        return "foreach"
    if flags.get("foreach") is False:
        return "for-loop"
    return None
