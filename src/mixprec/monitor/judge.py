"""What the monitor concludes from its sampled steps, as pure functions of the samples: a layer
whose range trend crosses the format's limit within the run, and half-precision weight updates that
round away. The fits are :mod:`mixprec.numerics.trend`'s, the same ones ``check`` judges with, on the
latest :data:`WINDOW` samples (a long run's early ranges say little about now, and the fit's cost
must not grow with the run), placed at the real steps of those samples."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mixprec.numerics.limits import FORMATS
from mixprec.numerics.trend import LayerSeries, least_headroom, outlook, predict

WINDOW = 32  # sampled steps a trend is fitted on (the latest)
STALL_LIMIT = 0.05  # the *-true check's max_stalled_update_fraction


@dataclass(frozen=True)
class Risk:
    """A predicted crossing: which direction (``forward``, ``backward`` or ``underflow``), where,
    at about which step, and the sentence that says so."""

    direction: str
    layer: str
    step: int
    headroom_bits: float
    message: str


def has_fp32_range(fmt: str) -> bool:
    """Whether ``fmt`` has fp32's exponent range (bf16): its largest value is fp32's to within a
    rounding (3.39e38 against 3.40e38), so what overflows it overflows fp32 too."""
    return FORMATS[fmt].exponent_bits >= FORMATS["fp32"].exponent_bits


def range_risk(
    window: Sequence[LayerSeries], first_step: int, interval: int, fmt: str, train_steps: int
) -> Risk | None:
    """The earliest crossing within ``train_steps`` the evidence supports, among ``window`` (the
    latest samples, evenly ``interval`` steps apart from ``first_step``)."""
    samples_left = max(1, (train_steps - first_step) // interval)
    # the run's first sample (step 0) is the initial weights' step, left out as check leaves it out
    seen = outlook(window, fmt, samples_left, start=0 if first_step else 1).at_risk
    if seen is None or seen.step is None:
        return None
    at = first_step + seen.step * interval
    text = seen.describe(train_steps)
    text = text.replace(f"at about step {seen.step} of", f"at about step {at} of")
    text = text.replace("bits/step", f"bits per {interval} steps")
    return Risk(seen.direction, seen.layer, at, seen.headroom_bits, text)


@dataclass(frozen=True)
class Stall:
    """Updates that rounded away: the share at the latest sample, and the step where the trend says
    it passes :data:`STALL_LIMIT` (None when it is past it already or not growing)."""

    fraction: float
    predicted_step: int | None


def stall(stalls: Sequence[tuple[int, float]], interval: int) -> Stall | None:
    """A stall the run must hear of: past the limit now, or growing towards it within the evidence."""
    if not stalls:
        return None
    window = list(stalls[-WINDOW:])
    now = window[-1][1]
    p = predict([v for _, v in window], STALL_LIMIT, layer="all weights", direction="updates", fmt="storage")
    growing = p is not None and p.trending and p.within_evidence and p.step is not None
    if now > STALL_LIMIT:
        return Stall(now, None)
    if growing and p is not None and p.step is not None:
        return Stall(now, window[0][0] + p.step * interval)
    return None


def culprit(series: Sequence[LayerSeries], fmt: str | None) -> tuple[str | None, str]:
    """The module to blame for a non-finite loss, from the latest sample, and how it was found:
    the one whose output was infinite while none of its submodules' was (it made the inf), or,
    when that sample stayed finite, the layer that came closest to the format's limit."""
    infinite = [s.name for s in series if s.forward and math.isinf(s.forward[-1])]
    module = next((n for n in infinite if not any(m.startswith(n + ".") for m in infinite)), None)
    if module is None and fmt is not None and series:
        module = least_headroom(series, fmt, n=1)[0]["layer"]
        return module, f"no infinite output at the sampled step; closest to the limit: {module!r}"
    if module is None:
        return None, "module not located: no layer's ranges were sampled at that step"
    return module, f"first infinite output in {module!r}"
