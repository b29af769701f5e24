"""The one clock that budgets, deadlines and the prices of work are read from: wall time
(``time.perf_counter``).

Read it as ``clock.now()`` (the module's attribute, looked up at each call), never as an imported
name: a test that plants its step times (a framework whose sessions report seconds they never
spend, tests/tuning/scripted.py) plants this clock too, so a budget pays for the planted work and
nothing else, and a tune decides the same on a busy machine as on a quiet one.
"""

from __future__ import annotations

import time


def now() -> float:
    """Seconds on the clock (an arbitrary origin: only differences mean anything)."""
    return time.perf_counter()
