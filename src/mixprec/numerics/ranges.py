"""Per-layer value ranges, forward and backward, of one training step: the summaries every
framework's collector fills (:class:`TensorRange`, :class:`LayerRanges`, :class:`RangeReport`), and
what each low-precision format would do to them: overflow, underflow to zero, precision lost as
subnormals, and the headroom (in powers of two) left below the format's largest finite value.

torch's collector (hooks on every module and on the autograd graph) is
:func:`mixprec.frameworks.torch.ranges.collect_ranges`; Keras records forward outputs only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.numerics.limits import FORMATS, LOW_PRECISION_FORMATS

__all__ = ["DEFAULT_SCALE", "FormatRange", "LayerRanges", "RangeReport", "TensorRange"]

DEFAULT_SCALE = 2.0**16  # torch.amp.GradScaler's init_scale


def _zeros() -> dict[str, float]:
    return dict.fromkeys(LOW_PRECISION_FORMATS, 0.0)


@functools.cache
def _thresholds(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, dict[Any, int]]:
    """The sorted thresholds every count is read at, in ``dtype``, and the index of each: |x| <= 0
    (zeros), |x| <= the dtype's largest finite value (finite), and per format |x| <= smallest
    subnormal / 2 (rounds to zero), |x| < smallest normal (the largest value below it, so "<="
    reads "<") and |x| <= max finite."""
    wanted: dict[Any, torch.Tensor] = {
        "zero": torch.tensor(0.0, dtype=dtype),
        "finite": torch.tensor(torch.finfo(dtype).max, dtype=dtype),  # |x| <= it: every finite value
    }
    for fmt in LOW_PRECISION_FORMATS:
        lim = FORMATS[fmt]
        normal = torch.tensor(lim.smallest_normal, dtype=dtype)
        wanted[fmt, "underflow"] = torch.tensor(lim.smallest_subnormal / 2, dtype=dtype)
        wanted[fmt, "subnormal"] = torch.nextafter(normal, torch.zeros((), dtype=dtype))
        wanted[fmt, "max"] = torch.tensor(lim.max_finite, dtype=dtype)
    bounds = torch.unique(torch.stack(list(wanted.values())))  # sorted
    at = {key: int(torch.searchsorted(bounds, value)) for key, value in wanted.items()}
    return bounds.to(device), at


@dataclass(frozen=True)
class FormatRange:
    """What one format would do to the values seen: fractions in [0, 1], headroom in bits."""

    overflow: float  # of all elements: |x| > max_finite (becomes inf/NaN or saturates); inf counts, NaN not
    underflow: float  # of finite non-zero elements: |x| <= smallest_subnormal / 2, rounds to zero
    subnormal: float  # of finite non-zero elements: |x| < smallest_normal (underflow included)
    headroom_bits: float | None  # log2(max_finite / absmax); < 0 overflows; None when absmax == 0


@dataclass
class TensorRange:
    """Streaming summary of every element seen; never keeps a tensor. Counts are float64."""

    count: float = 0.0  # elements seen
    nonfinite: float = 0.0  # inf or NaN
    absmax: float = 0.0  # largest |x| over non-NaN elements (inf when an inf was seen)
    min_nonzero: float | None = None  # smallest finite non-zero |x|; None if there was none
    zeros: float = 0.0
    nonzero: float = 0.0  # finite non-zero elements (the denominator of underflow/subnormal)
    tensors: int = 0  # tensors folded in
    dtypes: set[str] = field(default_factory=set)
    overflow_count: dict[str, float] = field(default_factory=_zeros)
    underflow_count: dict[str, float] = field(default_factory=_zeros)
    subnormal_count: dict[str, float] = field(default_factory=_zeros)

    @torch.no_grad()
    def update(self, t: torch.Tensor) -> bool:
        """Fold one tensor in (read-only, computed in fp32, or fp64 for fp64). True if it had inf/NaN.

        Every count comes from one pass: each element's bucket among the formats' thresholds
        (``torch.bucketize``), then one histogram of the buckets: a GPT's logits (51M elements)
        took seconds with a pass per threshold."""
        self.tensors += 1
        self.dtypes.add(str(t.dtype).removeprefix("torch."))
        if t.numel() == 0:
            return False
        a = t.detach().abs()  # before any cast: a complex tensor's magnitude, not its real part
        if a.dtype != torch.float64:
            a = a.float()
        a = a.flatten()
        bounds, at = _thresholds(a.dtype, a.device)
        # counts[i]: elements with bounds[i-1] < |x| <= bounds[i]; inf and NaN land past the last
        at_most = torch.bincount(torch.bucketize(a, bounds), minlength=len(bounds) + 1).cumsum(0)
        nan = torch.isnan(a)
        extrema = torch.stack(
            [a.masked_fill(nan, 0.0).max(), torch.where(a > 0, a, math.inf).min()]
        ).tolist()  # NaN > 0 is False, inf > 0 but is no "non-zero finite" minimum: min skips it below
        c = [float(v) for v in torch.stack([nan.sum(), at_most[at["finite"]], at_most[at["zero"]]]).tolist()]
        le = at_most.tolist()
        n = float(a.numel())
        nans, finite, zeros = c
        infs = n - nans - finite
        self.count += n
        self.nonfinite += nans + infs
        self.zeros += zeros
        self.nonzero += finite - zeros
        for fmt in LOW_PRECISION_FORMATS:
            self.overflow_count[fmt] += n - nans - le[at[fmt, "max"]]  # |x| > max finite: inf counts, NaN not
            self.underflow_count[fmt] += le[at[fmt, "underflow"]] - zeros  # 0 < |x| <= subnormal / 2
            self.subnormal_count[fmt] += le[at[fmt, "subnormal"]] - zeros  # 0 < |x| < smallest normal
        self.absmax = max(self.absmax, extrema[0])
        if math.isfinite(extrema[1]):
            self.min_nonzero = extrema[1] if self.min_nonzero is None else min(self.min_nonzero, extrema[1])
        return nans + infs > 0

    @torch.no_grad()
    def update_light(self, t: torch.Tensor, fmt: str | None) -> bool:
        """What a per-step series needs, at a fraction of :meth:`update`'s cost: the count, the
        largest magnitude and, for ``fmt``, the share of non-zero values that flush to zero (the
        zero count is kept only then: it is that share's denominator).

        The usual tensor is finite: one ``aminmax`` pass gives its largest magnitude and proves it,
        and the non-finite count is searched only when it is not. A tensor already stored in a dtype
        whose smallest subnormal is above ``fmt``'s flush threshold (an fp16 gradient, for fp16)
        holds nothing left to flush, so that share is not searched either."""
        self.tensors += 1
        n = t.numel()
        if n == 0:
            return False
        t = t.detach()
        lowest, highest = torch.aminmax(t)
        stats = [highest, lowest]
        if fmt is not None:
            half_sub = FORMATS[fmt].smallest_subnormal / 2
            stats.append(torch.count_nonzero(t == 0))
            tiny = torch.finfo(t.dtype)
            if float(tiny.smallest_normal) * float(tiny.eps) <= half_sub:
                stats.append(torch.count_nonzero(t.abs() <= half_sub))
        values = torch.stack([v.to(torch.float64) for v in stats]).tolist()
        self.count += n
        absmax = max(-values[1], values[0])
        if not math.isfinite(absmax):  # inf or NaN somewhere: count them, and the largest ignoring NaN
            a = t.abs().to(torch.float64 if t.dtype == torch.float64 else torch.float32)
            nonfinite = float((~torch.isfinite(a)).sum())
            absmax = float(a.masked_fill(torch.isnan(a), 0.0).max())
        else:
            nonfinite = 0.0
        self.nonfinite += nonfinite
        self.absmax = max(self.absmax, absmax)
        if fmt is not None:
            zeros = values[2]
            self.zeros += zeros
            self.nonzero += n - nonfinite - zeros
            if len(values) > 3:  # |x| <= half the smallest subnormal, zeros excluded (NaN compares false)
                self.underflow_count[fmt] += values[3] - zeros
        return nonfinite > 0

    def merge(self, other: TensorRange) -> TensorRange:
        """Fold another summary into this one (in place); returns self."""
        self.count += other.count
        self.nonfinite += other.nonfinite
        self.zeros += other.zeros
        self.nonzero += other.nonzero
        self.tensors += other.tensors
        self.dtypes |= other.dtypes
        self.absmax = max(self.absmax, other.absmax)
        if other.min_nonzero is not None:
            self.min_nonzero = (
                other.min_nonzero if self.min_nonzero is None else min(self.min_nonzero, other.min_nonzero)
            )
        for fmt in LOW_PRECISION_FORMATS:
            self.overflow_count[fmt] += other.overflow_count[fmt]
            self.underflow_count[fmt] += other.underflow_count[fmt]
            self.subnormal_count[fmt] += other.subnormal_count[fmt]
        return self

    @staticmethod
    def _check(fmt: str) -> None:
        if fmt not in LOW_PRECISION_FORMATS:
            raise KeyError(f"no counts kept for {fmt!r}; formats: {', '.join(LOW_PRECISION_FORMATS)}")

    def overflow_fraction(self, fmt: str) -> float:
        self._check(fmt)
        return self.overflow_count[fmt] / self.count if self.count else 0.0

    def underflow_fraction(self, fmt: str) -> float:
        self._check(fmt)
        return self.underflow_count[fmt] / self.nonzero if self.nonzero else 0.0

    def subnormal_fraction(self, fmt: str) -> float:
        self._check(fmt)
        return self.subnormal_count[fmt] / self.nonzero if self.nonzero else 0.0

    def headroom_bits(self, fmt: str) -> float | None:
        """log2(max_finite / absmax), any format in FORMATS; -inf if an inf was seen; None if absmax == 0."""
        if self.absmax == 0 or self.count == 0:
            return None
        if math.isinf(self.absmax):
            return -math.inf
        return math.log2(FORMATS[fmt].max_finite / self.absmax)

    def format(self, fmt: str) -> FormatRange:
        return FormatRange(
            overflow=self.overflow_fraction(fmt),
            underflow=self.underflow_fraction(fmt),
            subnormal=self.subnormal_fraction(fmt),
            headroom_bits=self.headroom_bits(fmt),
        )

    @property
    def formats(self) -> dict[str, FormatRange]:
        return {fmt: self.format(fmt) for fmt in LOW_PRECISION_FORMATS}

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "nonfinite": self.nonfinite,
            "absmax": self.absmax,
            "min_nonzero": self.min_nonzero,
            "zeros": self.zeros,
            "nonzero": self.nonzero,
            "tensors": self.tensors,
            "dtypes": sorted(self.dtypes),
            "formats": {fmt: vars(fr).copy() for fmt, fr in self.formats.items()},
        }


@dataclass
class LayerRanges:
    name: str  # qualified module name; the root is ""
    type: str  # class name
    order: int  # index of its first forward call among all module calls (pre-order: parents first)
    calls: int = 0  # forward calls seen
    forward: TensorRange = field(default_factory=TensorRange)  # the module's floating outputs
    backward: TensorRange = field(default_factory=TensorRange)  # gradients w.r.t. those outputs

    def min_headroom(self, fmt: str = "fp16") -> float | None:
        hs = [h for h in (self.forward.headroom_bits(fmt), self.backward.headroom_bits(fmt)) if h is not None]
        return min(hs) if hs else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "order": self.order,
            "calls": self.calls,
            "forward": self.forward.to_dict(),
            "backward": self.backward.to_dict(),
        }


@dataclass
class RangeReport:
    layers: list[LayerRanges]  # modules that ran, in forward execution order
    first_nonfinite_forward: str | None = None
    first_nonfinite_backward: str | None = None
    grad_underflow_fp16: dict[str, float] = field(default_factory=dict)
    loss: float | None = None  # the unscaled loss of the step

    def layer(self, name: str) -> LayerRanges:
        for lr in self.layers:
            if lr.name == name:
                return lr
        raise KeyError(f"no module named {name!r} ran in the step")

    def worst(self, n: int = 5, fmt: str = "fp16") -> list[LayerRanges]:
        """The ``n`` layers with the least headroom in ``fmt``, forward or backward, least first.

        Layers that saw only zeros are left out; on a tie the module that started later (a child rather
        than the container passing the same tensor on) comes first.
        """
        ranked = [(h, -lr.order, lr) for lr in self.layers if (h := lr.min_headroom(fmt)) is not None]
        ranked.sort(key=lambda r: (r[0], r[1]))
        return [lr for _, _, lr in ranked[:n]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [lr.to_dict() for lr in self.layers],
            "first_nonfinite_forward": self.first_nonfinite_forward,
            "first_nonfinite_backward": self.first_nonfinite_backward,
            "grad_underflow_fp16": dict(self.grad_underflow_fp16),
            "loss": self.loss,
        }
