"""Exception hierarchy. Every message repeats the bad value, lists the valid ones and names the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# Exit codes of the CLI beyond those of the errors below (docs/cli.md has the table).
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT)
EXIT_TERMINATED = 143  # SIGTERM


class MixprecError(Exception):
    """Base class of every error mixprec raises on purpose."""

    exit_code = 1


class PolicyError(MixprecError, ValueError):
    """A policy name or option is invalid, or a policy is used the wrong way."""

    exit_code = 2


class UsageError(MixprecError, ValueError):
    """Bad command-line or API input that is not about a policy (paths, sizes, flags)."""

    exit_code = 2


class ExportRefused(UsageError):
    """An export target cannot express a policy faithfully on a device; the message says why and
    names the nearest faithful alternative (see :func:`mixprec.exports.export_status`). ``entry``:
    the precision-map entry or Linear layer a precision-map target cannot express, else None."""

    exit_code = 2

    def __init__(
        self,
        target: str,
        policy: str,
        device: str,
        reason: str,
        alternative: str,
        *,
        entry: str | None = None,
    ) -> None:
        super().__init__(
            f"Cannot export policy {policy!r} on {device} to {target}: {reason}. "
            f"Nearest faithful alternative: {alternative}."
        )
        self.target = target
        self.policy = policy
        self.device = device
        self.reason = reason
        self.alternative = alternative
        self.entry = entry


class UnsupportedError(MixprecError):
    """The requested policy cannot run on this device."""

    exit_code = 3


class ScaleCollapseError(MixprecError, FloatingPointError):
    """fp16 gradients keep overflowing although the loss scale already sits at its floor."""

    exit_code = 4

    def __init__(self, message: str, parameters: list[str]) -> None:
        super().__init__(message)
        self.parameters = parameters


class NonFiniteGradientsError(MixprecError, FloatingPointError):
    """A policy without a loss scaler (``finite_check=True``) skipped this many optimizer steps in a
    row on non-finite gradients: training is not recovering, it only skips. The counterpart of
    :class:`ScaleCollapseError` for bf16 and the other unscaled policies."""

    exit_code = 4

    def __init__(self, message: str, parameters: list[str]) -> None:
        super().__init__(message)
        self.parameters = parameters


class NonFiniteWeightsError(MixprecError, FloatingPointError):
    """Raised where :class:`ScaleCollapseError` or :class:`NonFiniteGradientsError` would be when the
    weights themselves hold inf/NaN: every gradient is then NaN and no loss scale or skip helps (an
    optimizer step wrote them, e.g. fp16 Adam whose eps rounds to 0). ``parameters`` names them."""

    exit_code = 4

    def __init__(self, message: str, parameters: list[str]) -> None:
        super().__init__(message)
        self.parameters = parameters


class NumericsFailed(MixprecError):
    """No candidate passed the numerics check (``check`` and ``tune`` exit with it)."""

    exit_code = 4


class NumericsInconclusive(MixprecError):
    """The numerics could not be verified: the strict-fp32 reference did not learn over the checked
    steps (beyond its own run-to-run spread), so a comparison with it has no power. ``check`` exits
    with it when no candidate failed but some were inconclusive; ``tune`` when its pick was made on
    speed alone ("numerics not verified")."""

    exit_code = 6


class RunStopped(MixprecError):
    """``mixprec run``'s monitor stopped the user's run (its rescues spent, the run still failing,
    or a failure no rescue answers); the message says why."""

    exit_code = 4


class BudgetExhausted(MixprecError):
    """``tune`` ran out of its time budget before it could decide anything; the message says how
    far it got and how much budget to give it."""

    exit_code = 5


class MixprecWarning(UserWarning):
    """Base class of mixprec's warnings; the CLI prints them as one line."""


class CacheWarning(MixprecWarning):
    """A cache file could not be read or written; it is treated as a miss, nothing is lost."""


def did_you_mean(value: str, valid: Iterable[str]) -> str:
    """' Did you mean 'x'?' when a close match exists, else ''."""
    matches = difflib.get_close_matches(value, list(valid), n=1, cutoff=0.5)
    return f" Did you mean '{matches[0]}'?" if matches else ""


# What an exception looks like when memory ran out: CUDA raises ``torch.OutOfMemoryError``, the CPU
# allocator a plain ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory"), Python a
# ``MemoryError``.
_OOM_TYPES = ("OutOfMemoryError", "MemoryError")
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


def is_out_of_memory(error_type: str, message: str) -> bool:
    """True for an exception (by type name and message) that means memory ran out."""
    lowered = message.lower()
    return any(t in error_type for t in _OOM_TYPES) or any(m in lowered for m in _OOM_MESSAGES)
