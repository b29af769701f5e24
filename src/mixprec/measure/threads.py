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

# Counts whose steps are within this share of the fastest are a tie (run-to-run noise), and a tie
# goes to the fewest threads: a thread more that does not make the step faster only adds a barrier
# to wait at when another process takes its core. In a busy `make demo` on the 2-core EPYC (two
# spinning processes beside it) the strict-fp32 step took 3.47 s at 1 thread and 3.45 s at 2; kept
# at 2, the sweep's steps then took 10 s, and the budget ended with only fp32 measured.
TIE_WITHIN = 1.10
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
        # (why the last clause: a speedup measured at another thread count is another figure. Quiet
        # at 2 threads and beside one busy loop at 1, fp32+cl read 1.36x vs 1.10x on the AMX Xeon;
        # on the Xeon without AMX 1.05x vs 1.17x once and within 4% three times: the count and the
        # contention together, benchmarks/busy_bench.py)
        return (
            f"contention: the strict-fp32 step took {slow / best:.1f}x as long at {self.default} threads "
            f"as at {self.threads} (another process holds a core; OpenMP's threads wait for it): "
            "samples/s are what the cores free now give, not the quiet machine's; the speedups are "
            "paired step by step, which contention moves far less, but they are the speedups at "
            f"{self.threads} thread{'s' if self.threads != 1 else ''}, which can differ from those "
            f"at {self.default} on a quiet machine"
        )

    @property
    def reason(self) -> str:
        times = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in sorted(self.step_s.items()))
        if self.threads == self.default:
            return f"measured at {self.threads} threads, the fastest count now (strict-fp32 step {times})"
        chosen, default = self.step_s.get(self.threads), self.step_s.get(self.default)
        tie = f"as fast now (within {TIE_WITHIN - 1:.0%}), and fewer threads wait less for a busy core"
        why = "faster now" if chosen and default and default > TIE_WITHIN * chosen else tie
        return (
            f"measured at {self.threads} threads instead of {self.default}: {why} (strict-fp32 step {times})"
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
    """The count to measure at: the fewest threads within :data:`TIE_WITHIN` of the fastest."""
    usable = {n: s for n, s in step_s.items() if s > 0}
    if not usable:
        raise UsageError(f"no thread count could be timed (got {step_s!r}); pass threads=N.")
    fastest = min(usable.values())
    best = min(n for n, s in usable.items() if s <= TIE_WITHIN * fastest)
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
