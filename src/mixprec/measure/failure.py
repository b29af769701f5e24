"""What a candidate's failure was: out of memory, or another error.

CUDA raises ``torch.OutOfMemoryError``; the CPU allocator raises a plain ``RuntimeError``
("DefaultCPUAllocator: can't allocate memory"), Python a ``MemoryError``. All three are ``oom``
rows: the candidate needs more memory than there is, which a smaller batch fixes, unlike an error.
"""

from __future__ import annotations

from mixprec.errors import is_out_of_memory
from mixprec.status import Status

__all__ = ["exception_status", "failure_status", "is_out_of_memory"]


def failure_status(error_type: str, message: str) -> Status:
    """``oom`` or ``error`` for a failure given by its exception's type name and message."""
    return Status.OOM if is_out_of_memory(error_type, message) else Status.ERROR


def exception_status(exc: BaseException) -> Status:
    return failure_status(type(exc).__name__, str(exc))
