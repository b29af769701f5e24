"""What a candidate's failure was: out of memory, or another error.

CUDA raises ``torch.OutOfMemoryError``; the CPU allocator raises a plain ``RuntimeError``
("DefaultCPUAllocator: can't allocate memory"), Python a ``MemoryError``. All three are ``oom``
rows: the candidate needs more memory than there is, which a smaller batch fixes, unlike an error.
"""

from __future__ import annotations

from mixprec.status import Status

_OOM_TYPES = ("OutOfMemoryError", "MemoryError")
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


def is_out_of_memory(error_type: str, message: str) -> bool:
    """True for an exception (by type name and message) that means memory ran out."""
    lowered = message.lower()
    return any(t in error_type for t in _OOM_TYPES) or any(m in lowered for m in _OOM_MESSAGES)


def failure_status(error_type: str, message: str) -> Status:
    """``oom`` or ``error`` for a failure given by its exception's type name and message."""
    return Status.OOM if is_out_of_memory(error_type, message) else Status.ERROR


def exception_status(exc: BaseException) -> Status:
    return failure_status(type(exc).__name__, str(exc))
