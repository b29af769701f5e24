"""How every report writes numbers, and the rich style of each status tone: one place for both.

The formatters take what a result holds (floats, None, inf/NaN, or the strings JSON turns
non-finite numbers into) and return display text, empty when there is nothing to show.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from typing import Any

from mixprec.status import tone

# Rich styles per status tone (mixprec.status.TONES); the HTML report has the same tones in CSS.
RICH_STYLES = {"best": "bold green", "good": "green", "bad": "red", "warn": "yellow", "muted": "dim"}


def rich_style(status: str) -> str:
    """The rich style of ``status``'s tone."""
    return RICH_STYLES[tone(status)]


def num(x: Any) -> float | None:
    """A number, or None; JSON writes inf/NaN as strings, so those come back as floats."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def finite(x: float | None) -> bool:
    """``x`` is a finite number (not None, inf or NaN)."""
    return x is not None and math.isfinite(x)


def fmt_speedup(x: Any) -> str:
    """A throughput ratio: '2.06x'."""
    v = num(x)
    return f"{v:.2f}x" if finite(v) else ""


def fmt_speedup_ci(x: Any, ci: Any = None) -> str:
    """A speedup with its 95% interval when there is one: '1.84x [1.70-1.95]'."""
    text = fmt_speedup(x)
    lo, hi = (num(ci[0]), num(ci[1])) if isinstance(ci, (list, tuple)) and len(ci) == 2 else (None, None)
    if text and finite(lo) and finite(hi):
        text += f" [{lo:.2f}-{hi:.2f}]"
    return text


def fmt_throughput(x: Any) -> str:
    """Samples per second: '1,481.4'."""
    v = num(x)
    return f"{v:,.1f}" if finite(v) else ""


def fmt_bytes(x: Any) -> str:
    """Bytes as KiB (below 1 MiB), MiB or GiB; negative values keep their sign."""
    v = num(x)
    if v is None or not math.isfinite(v):
        return ""
    sign, a = ("-" if v < 0 else ""), abs(v)
    if a >= 2**30:
        return f"{sign}{a / 2**30:.2f} GiB"
    if a >= 2**20:
        return f"{sign}{a / 2**20:.1f} MiB"
    if a >= 2**10:
        return f"{sign}{a / 2**10:.1f} KiB"
    return f"{sign}{a:.0f} B"


def fmt_ms(median: Any, iqr: Any = None) -> str:
    """A step time: 'median ± IQR' in milliseconds."""
    med, spread = num(median), num(iqr)
    if not finite(med):
        return ""
    return f"{med:.1f} ± {spread:.1f}" if finite(spread) else f"{med:.1f}"


def fmt_pct(x: Any, digits: int = 1, sign: bool = False) -> str:
    """A fraction as a percentage (0.123 -> '12.3%'); ``sign`` writes '+' on positive values."""
    v = num(x)
    if v is None:
        return ""
    if not math.isfinite(v):
        return "inf" if v > 0 else ("-inf" if v < 0 else "nan")
    return f"{v:{'+' if sign else ''}.{digits}%}"


def fmt_small_pct(x: Any) -> str:
    """Relative differences: 2 significant digits, so 2e-5 shows as 0.0020%, not 0.00%."""
    v = num(x)
    if v is None:
        return ""
    if not math.isfinite(v):
        return fmt_pct(v)
    if v == 0:
        return "0%"
    return f"{v * 100:.2g}%" if abs(v) < 0.01 else f"{v:.2%}"


def fmt_db(x: Any, unit: bool = True) -> str:
    """Decibels to one decimal: '14.7 dB' (without the unit when ``unit`` is False)."""
    v = num(x)
    if v is None:
        return ""
    text = f"{v:.1f}" if math.isfinite(v) else ("inf" if v > 0 else "-inf" if v < 0 else "nan")
    return f"{text} dB" if unit else text


def fmt_bits(x: Any) -> str:
    """Signed headroom in bits: '+3.5 bits', 'n/a' when unknown."""
    v = num(x)
    if v is None:
        return "n/a"
    return f"{v:+.1f} bits" if math.isfinite(v) else str(v)


def fmt_seconds(x: Any) -> str:
    """A duration in whole seconds: '17 s'."""
    v = num(x)
    return f"{v:.0f} s" if finite(v) else ""


def fmt_date(x: Any) -> str:
    """An ISO timestamp as '2026-11-22 11:30 UTC'; text that is not one is returned as is."""
    if not isinstance(x, str) or not x:
        return ""
    try:
        t = dt.datetime.fromisoformat(x.replace("Z", "+00:00"))
    except ValueError:
        return x
    if t.tzinfo is not None and t.utcoffset() == dt.timedelta(0):
        return t.strftime("%Y-%m-%d %H:%M UTC")
    return t.strftime("%Y-%m-%d %H:%M %z").strip()


def fmt_gain(gain: Any) -> str:
    """A lint finding's measured gain (``MeasuredGain.to_dict()``): '+4.2% step; step 5.00 → 4.79 ms'.

    The percentage is the step's gain when the step was timed, else the layer's.
    """
    g = gain if isinstance(gain, dict) else {}
    parts = []
    pct = num(g.get("gain_pct"))
    if finite(pct):
        what = "step" if finite(num(g.get("step_gain_pct"))) else "layer"
        parts.append(f"{pct:+.1f}% {what}")
    for what in ("step", "layer"):
        before, after = num(g.get(f"{what}_before_ms")), num(g.get(f"{what}_after_ms"))
        if finite(before) and finite(after):
            parts.append(f"{what} {before:.2f} → {after:.2f} ms")
    return "; ".join(parts)


# tune's stages, in the order they run (TuneResult.phases)
PHASES = ("speed", "numerics", "compile", "race", "prediction", "other")


def phase_seconds(phases: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    """``TuneResult.phases`` as (phase, seconds) in :data:`PHASES` order (unknown phases after them,
    as recorded), leaving out phases that round to 0 s and values that are not numbers."""
    order = [*(p for p in PHASES if p in phases), *(p for p in phases if p not in PHASES)]
    out = []
    for name in order:
        seconds = num(phases[name])
        if seconds is not None and math.isfinite(seconds) and seconds >= 0.5:
            out.append((str(name), seconds))
    return tuple(out)


def fmt_phases(phases: Mapping[str, Any], budget_s: Any = None) -> str:
    """Where tune's time went, for one line: 'speed 120 s, numerics 80 s, other 5 s of 300 s'
    (without 'of' when the budget is unknown); empty when no phase was recorded."""
    text = ", ".join(f"{name} {fmt_seconds(s)}" for name, s in phase_seconds(phases))
    budget = num(budget_s)
    return f"{text} of {fmt_seconds(budget)}" if text and finite(budget) and budget else text


def shorten(text: str, width: int, placeholder: str = "…") -> str:
    """``text`` on one line, at most ``width`` characters: cut at the last word boundary that fits,
    trailing punctuation dropped, ``placeholder`` appended. A first word longer than ``width`` on
    its own is the one case cut inside a word."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    room = max(0, width - len(placeholder))
    cut = flat.rfind(" ", 0, room + 1)
    kept = flat[:cut] if cut > 0 else flat[:room]
    return kept.rstrip(" ,;:") + placeholder
