"""The order tune measures its candidates in: where the answer is predicted to be, first.

A budget that ends early should still leave the best candidates measured, so the sweep (and the
``--batch auto`` memory search before it) runs strict fp32 first (the reference every speedup is
paired with), then each precision family in the order of its predicted speed on this device, each
family's variants (layouts) right after its leader, and last the families predicted to be slower
than strict fp32 (measured only if the budget reaches them). strict fp32's own variants (channels_last)
are a family predicted at fp32's speed: after the families predicted faster. (With them second, a
busy 2-core EPYC spent the default budget's sweep and a race on fp32 and fp32+cl, and bf16-mixed,
predicted twice as fast, was never measured.)

The prediction is the format's measured speed here over fp32's (:mod:`mixprec.hardware.formats`:
a cached matmul and convolution probe on a CPU, the datasheet on a GPU), so on a Xeon with AMX bf16
leads, on one without AVX512-BF16 it comes last, and fp16 without a fast convolution kernel comes
last for a CNN. It orders; it never prunes: every candidate is still measured when the
budget allows.

A low-format family (fp8, MXFP8, NVFP4) is not ranked by its format's peak: it runs only the
eligible Linear GEMMs in that format and everything else in its carrier (bf16-mixed), and in eager
mode its scaling casts cost more than those GEMMs save. On an H200 (2026-11-27, the zoo GPT at 2
layers x 2048) eager fp8-rowwise/tensorwise ran at 0.75x/0.77x bf16-mixed and compiled at 0.96x/1.005x,
while the datasheet ranks fp8 at twice bf16; a tune ordered by the peak spent its 80 s budget on
fp8 and never measured bf16-mixed. So a low format is measured right after its carrier.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from mixprec.hardware.device import DeviceInfo
from mixprec.hardware.formats import FormatSpeed, format_speed
from mixprec.policy import POLICY_NAMES, Candidate
from mixprec.policy.registry import carrier

Gain = Callable[[Candidate], float | None]


def measured_gain(info: DeviceInfo, *, conv: bool) -> Gain:
    """A candidate's predicted speed over strict fp32: its format's measured rate on ``info``
    (:mod:`mixprec.hardware.formats`), the convolutions' for a model with ``conv`` layers; None
    where there is none (fp8 on a CPU): the order then falls back on the registry's."""
    speeds: dict[str, FormatSpeed] = {}

    def gain(candidate: Candidate) -> float | None:
        key = candidate.spec.peak_key  # fp32's own rate is 1.0; a format not measurable here, None
        if key not in speeds:
            speeds[key] = format_speed(info, key, conv=conv)
        return speeds[key].rate(conv)

    return gain


def sweep_order(candidates: Sequence[Candidate], gain: Gain) -> list[Candidate]:
    """``candidates`` grouped by precision family after strict fp32 (the first fp32 candidate), by
    predicted ``gain`` (highest first; ties: the format that computes in half precision, then
    strict fp32's variants, then the registry's order), families predicted slower than fp32 last;
    within a family the order given. A script's own precision (``as_written``) leads: it is what
    the user runs today."""
    families: dict[str, list[Candidate]] = {}
    reference = next((c for c in candidates if c.policy == "fp32" and not c.as_written), None)
    for cand in candidates:
        if not cand.as_written and cand is not reference:
            families.setdefault(cand.policy, []).append(cand)

    def key(policy: str) -> tuple:
        if policy == "fp32":  # its variants: at strict fp32's own speed (1.0), ties after the half formats
            return (1, -1.0, 1, -1, 0)
        low_format_carrier = carrier(policy)  # right after it, never ahead of it (the docstring)
        if low_format_carrier is not None:
            return (*key(low_format_carrier)[:-1], 1)
        leader = families[policy][0] if policy in families else Candidate(policy)
        predicted = gain(leader)
        value = 1.0 if predicted is None else predicted
        half = leader.spec.low_precision_dtype is not None
        registry = POLICY_NAMES.index(policy) if policy in POLICY_NAMES else len(POLICY_NAMES)
        return (1 if value >= 1.0 else 2, -value, 0 if half else 1, registry, 0)

    ordered = [cand for policy in sorted(families, key=key) for cand in families[policy]]
    first = [c for c in candidates if c.as_written] + ([reference] if reference is not None else [])
    return first + ordered


def ordered(candidates: Sequence[Candidate], info: DeviceInfo) -> list[Candidate]:
    """Tune's plan in its measuring order on ``info``. A plan with channels_last variants is a
    model with convolutions (backends plan that layout only for 4-D weights): their rate decides."""
    conv = any(c.channels_last for c in candidates)
    return sweep_order(candidates, measured_gain(info, conv=conv))


def tune_plan(framework: Any, workload: Any, info: DeviceInfo, policies: Collection[str]) -> list[Candidate]:
    """The backend's tune candidates among ``policies`` (canonical names), validated, in measuring
    order. Strict fp32 and a script's own precision (``as_written``) are always in: every row is
    paired with the first, and the second is what the user runs today."""
    wanted = [
        c
        for c in framework.tune_candidates(workload, info)
        if c.policy in policies or c.policy == "fp32" or c.as_written
    ]
    return [framework.validate(c) for c in ordered(wanted, info)]
