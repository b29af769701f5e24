"""Intra-op threads that fit the cores that are free now, and contention that is seen.

On a shared 2-core Xeon with one other busy process, a model ran 9.9 samples/s at the default 2
threads and 382-435 samples/s at 1: OpenMP's threads wait at every barrier for the one whose core is
taken. A noise estimate from the spread of step times cannot see that (every step is slow alike).
So before a CPU sweep, the strict-fp32 step is timed at 1..N threads (:meth:`Framework.thread_probe`)
and every candidate and the baseline are measured at the fastest count: both sides of a pair still
run at the same threads. A default count many times slower than a smaller one is contention, said
so in the result rather than measured as if the machine were quiet.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mixprec.errors import UsageError

# The default count is kept unless a smaller one is at least this much faster (run-to-run noise).
KEEP_DEFAULT_WITHIN = 1.10
# The default count this many times slower than the fastest: the cores are not free.
CONTENDED = 1.5


@dataclass(frozen=True)
class ThreadChoice:
    """The threads a sweep measures at, from the strict-fp32 step timed at each count.

    Attributes:
        threads: the count every candidate runs at.
        default: the count torch would use (``torch.get_num_threads()`` before the choice).
        step_s: median seconds of the probe step per thread count.
    """

    threads: int
    default: int
    step_s: dict[int, float]

    @property
    def contended(self) -> str | None:
        """Why the cores look busy (the default count far slower than the chosen one), or None."""
        slow, best = self.step_s.get(self.default), self.step_s.get(self.threads)
        if self.threads == self.default or not slow or not best or slow < CONTENDED * best:
            return None
        return (
            f"contention: the strict-fp32 step took {slow / best:.1f}x as long at {self.default} threads "
            f"as at {self.threads} (another process holds a core; OpenMP's threads wait for it): "
            "samples/s are what the cores free now give, not the quiet machine's; the speedups are "
            "paired step by step, which contention moves far less"
        )

    @property
    def reason(self) -> str:
        times = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in sorted(self.step_s.items()))
        if self.threads == self.default:
            fastest = min(self.step_s, key=lambda n: self.step_s[n]) if self.step_s else self.threads
            why = (
                "the fastest count now"
                if fastest == self.threads
                else "the default, within 10% of the fastest"
            )
            return f"measured at {self.threads} threads, {why} (strict-fp32 step {times})"
        return (
            f"measured at {self.threads} threads instead of {self.default}: faster now "
            f"(strict-fp32 step {times})"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "threads": self.threads,
            "default": self.default,
            "step_ms": {str(n): round(s * 1e3, 3) for n, s in sorted(self.step_s.items())},
            "contended": self.contended,
        }


def counts(default: int) -> list[int]:
    """The thread counts worth timing up to ``default``: 1, the powers of two, ``default``."""
    found, n = {default}, 1
    while n < default:
        found.add(n)
        n *= 2
    return sorted(found)


def choose(step_s: dict[int, float], default: int) -> ThreadChoice:
    """The count to measure at: the fastest, but the default unless another is clearly faster."""
    usable = {n: s for n, s in step_s.items() if s > 0}
    if not usable:
        raise UsageError(f"no thread count could be timed (got {step_s!r}); pass threads=N.")
    best = min(usable, key=lambda n: usable[n])
    if default in usable and usable[default] <= KEEP_DEFAULT_WITHIN * usable[best]:
        best = default
    return ThreadChoice(best, default, usable)


def user_fixed() -> bool:
    """The user chose the threads for this process (OMP_NUM_THREADS): measure at theirs."""
    return bool(os.environ.get("OMP_NUM_THREADS"))


def pick_threads(
    framework: Any, workload: Any, config: Any, device: str, batch_size: int
) -> ThreadChoice | None:
    """The threads ``config`` (a BenchConfig) measures at: its own count, or with 'auto' on a CPU
    the fastest now (None: the framework's current count stands, nothing was timed)."""
    if config.threads != "auto":
        return ThreadChoice(int(config.threads), framework.threads(), {})
    default = framework.threads()
    if not device.startswith("cpu") or default < 2 or user_fixed() or config.nproc > 1:
        return None
    try:
        step_s = framework.thread_probe(workload, device, batch_size, counts(default))
    except Exception:  # an optimisation, not a measurement: a batch that does not fit, say, is the
        return None  # sweep's to report (a row), measured at the default count
    return choose(step_s, default) if step_s else None


@contextlib.contextmanager
def threads_kept() -> Iterator[None]:
    """Put torch's intra-op thread count back on exit: a candidate measured in this process sets
    the chosen count, and the caller's process must not keep it."""
    import torch

    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
