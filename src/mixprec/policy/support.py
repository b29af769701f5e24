"""Whether a policy runs on a device, natively or emulated, why, and what to use instead."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mixprec.hardware.device import DeviceInfo
from mixprec.policy.registry import DEVICE_TYPES, POLICIES, PolicySpec, canonical_name, mixed_twin


@dataclass(frozen=True)
class Support:
    """Whether a policy can run on a device, why, and what to use instead.

    Attributes:
        supported: the policy runs here (possibly slowly, see ``native``).
        reason: one sentence a user can act on.
        suggestion: the first policy of the fallback chain that runs natively here, when this
            one is unsupported or only emulated.
        native: the device computes the format in hardware; False where it is emulated
            through fp32 and usually slower than fp32.
    """

    supported: bool
    reason: str
    suggestion: str | None = None
    native: bool = True

    def __bool__(self) -> bool:
        return self.supported


def _assess(spec: PolicySpec, info: DeviceInfo) -> tuple[bool, bool, str]:
    """(supported, native, reason) without suggestions."""
    cc = f"compute capability {info.capability[0]}.{info.capability[1]}" if info.capability else ""
    if spec.name == "fp32":
        return True, True, "strict IEEE fp32 works everywhere"
    if spec.name == "tf32":
        if info.type != "cuda":
            return (
                False,
                False,
                "TF32 needs an NVIDIA GPU with compute capability >= 8.0; this device is a CPU",
            )
        if not info.tf32:
            return False, False, f"TF32 needs compute capability >= 8.0, this GPU has {cc}"
        if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
            # cuBLAS/cuDNN ignore every TF32 request then: a tf32 row would be fp32 under a tf32 label
            return (
                False,
                False,
                "NVIDIA_TF32_OVERRIDE=0 is set: the CUDA libraries refuse TF32 in this process",
            )
        return True, True, f"TF32 tensor cores ({cc})"
    if spec.fp8_recipe is not None:
        return _assess_fp8(info, cc)
    if spec.block_format is not None:
        return _assess_block(spec.name, info, cc)
    if spec.name == "bf32":
        if info.type != "cpu":
            return False, False, "bf32 is a oneDNN (CPU) math mode; cuBLAS has no bf16 fp32-mode"
        if not info.mkldnn_available:
            return False, False, "this torch build has no oneDNN (mkldnn)"
        if not info.native_bf16:
            return False, False, "bf32 needs AVX512-BF16 or AMX on the CPU; this CPU has neither"
        if info.bf32_changes is not None and not info.bf32_changes:
            return (
                True,
                False,
                "oneDNN bf16 math changes neither matmuls nor convolutions on this CPU: no effect",
            )
        if info.bf32_changes == ("matmul",):
            return (
                True,
                True,
                "oneDNN bf16 math on a CPU with native bf16, for large matmuls only here: convolutions "
                "stay bit-identical to fp32 (no effect on conv-dominated models)",
            )
        return True, True, "oneDNN bf16 math on a CPU with native bf16"
    if spec.low_precision_dtype == torch.bfloat16:
        if info.type == "cuda":
            if not info.native_bf16:
                return False, False, f"bf16 on {cc} is emulated (needs >= 8.0) and slower than fp32"
            return True, True, f"native bf16 ({cc})"
        if info.native_bf16:
            return True, True, "native bf16 on this CPU (AVX512-BF16/AMX)"
        return True, False, "bf16 on this CPU is emulated: expect it to be slower than fp32"
    # fp16
    if info.type == "cuda":
        if not info.native_fp16:
            return False, False, f"fp16 tensor cores need compute capability >= 7.0, this GPU has {cc}"
        return True, True, f"fp16 tensor cores ({cc})"
    if info.native_fp16:
        return True, True, "native fp16 on this CPU (AVX512-FP16/AMX-FP16)"
    return (
        True,
        False,
        "no native fp16 on this CPU (AVX512-FP16/AMX-FP16): runs, but often far slower than fp32",
    )


def _assess_fp8(info: DeviceInfo, cc: str) -> tuple[bool, bool, str]:
    from mixprec.policy.fp8 import torchao_available

    if info.type != "cuda":
        return (
            False,
            False,
            "fp8 training needs an NVIDIA GPU with compute capability >= 8.9 (fp8 tensor cores); this "
            "device is a CPU (`mixprec check` still predicts its numerics here with torchao's recipe)",
        )
    if not info.fp8:  # fp8 tensor cores: Ada (8.9), Hopper (9.0) and later
        return False, False, f"fp8 tensor cores need compute capability >= 8.9, this GPU has {cc}"
    if not torchao_available():
        return False, False, "fp8 training runs through torchao.float8: pip install 'mixprec[fp8]'"
    return True, True, f"fp8 tensor cores ({cc}) via torchao.float8"


def _assess_block(name: str, info: DeviceInfo, cc: str) -> tuple[bool, bool, str]:
    from mixprec.policy.fp8 import torchao_available

    predicted = f"`mixprec check` predicts its numerics here with mixprec's {name} emulation"
    needs = f"{name} needs Blackwell data-center tensor cores (compute capability 10.x)"
    if info.type != "cuda":
        return False, False, f"{needs}; this device is a CPU ({predicted})"
    if not info.capability or info.capability[0] != 10:
        # torchao's block-format kernels are sm_100's (B200, GB200): not sm_120 (RTX 50) or later
        return False, False, f"{needs}, this GPU has {cc} ({predicted})"
    if not torchao_available():
        return False, False, f"{name} runs on torchao's kernels: pip install 'mixprec[fp8]' ({predicted})"
    return True, True, f"{name} tensor cores ({cc}) via torchao"


def fp8_predictable(name: str, info: DeviceInfo) -> bool:
    """A low-format policy (fp8, MXFP8, NVFP4) that cannot run fast here but whose numerics can be
    computed here: torchao's fp8 recipe runs on any device (torch._scaled_mm has reference
    kernels), only slowly; the block formats run mixprec's emulation (mixprec.policy.blockscale)."""
    spec = POLICIES[canonical_name(name)]
    from mixprec.policy.fp8 import torchao_available

    if spec.low_format is None or _assess(spec, info)[0]:
        return False
    return spec.block_format is not None or torchao_available()


def prediction_label(name: str, info: DeviceInfo) -> str | None:
    """How the numerics of policy ``name`` are predicted on this device where it cannot run fast
    (:func:`fp8_predictable`), in one line for the report; None where they are not."""
    if not fp8_predictable(name, info):
        return None
    spec = POLICIES[canonical_name(name)]
    reason = check_support(name, info).reason.split(";")[0].split(" (")[0]
    how = (
        f"torchao's {spec.fp8_recipe} fp8 recipe run here with the scales and fp8 casts an fp8 GPU "
        "applies (torch._scaled_mm reference kernels)"
        if spec.fp8_recipe is not None
        else f"mixprec's emulation of the {spec.name} recipe run here (its block scales, element "
        "rounding and gradient rounding, bit for bit torchao's emulated kernels where torchao has "
        "them; fp32 accumulation)"
    )
    return f"numerics predicted on {info.type}: {how}; speed is not measurable here ({reason})"


def check_support(name: str, info: DeviceInfo) -> Support:
    """Support of policy ``name`` on the device described by ``info``. Never raises for known names.

    Where the policy is unsupported or only emulated, ``suggestion`` names the first policy
    of its fallback chain that runs natively on this device.
    """
    spec = POLICIES[canonical_name(name)]
    if info.type not in DEVICE_TYPES:
        return Support(False, f"device type {info.type!r} is not supported", "fp32 on cpu or cuda", False)
    supported, native, reason = _assess(spec, info)
    if native:
        return Support(supported, reason)
    suggestion = next((alt for alt in spec.fallbacks if _assess(POLICIES[alt], info)[1]), "fp32")
    return Support(supported, reason, suggestion, native=False)


def starting_policy(info: DeviceInfo) -> str:
    """The policy a newcomer should start from on this device, before measuring anything: the
    natively supported starting point of lowest ``starting_rank`` (see :class:`PolicySpec`)."""
    starts = [s for s in POLICIES.values() if s.starting_rank is not None and info.type in s.starting_devices]
    for spec in sorted(starts, key=lambda s: s.starting_rank or 0):
        support = check_support(spec.name, info)
        if support and support.native:
            return spec.name
    return "fp32"


def support_table(info: DeviceInfo) -> list[dict[str, object]]:
    """One row per policy: supported, native, reason, suggestion, on the device ``info`` describes."""
    from mixprec.policy.registry import POLICY_NAMES

    return [
        {
            "policy": name,
            "supported": s.supported,
            "native": s.native,
            "reason": s.reason,
            "suggestion": s.suggestion,
        }
        for name in POLICY_NAMES
        for s in (check_support(name, info),)
    ]


def cures(name: str, problem: str, info: DeviceInfo, fmt: str) -> list[str]:
    """Policies to try where ``name`` failed its numerics check in ``fmt`` (``problem``: 'range',
    an overflow, or 'precision', rounding), among those the device ``info`` computes natively: for
    rounding, a *-true policy's *-mixed twin first (fp32 master weights; the same format, so the same
    speed whatever the hardware), then every other policy below fp32's cost whose range (or rounding)
    format is not ``fmt``, the safest first. A format the device only emulates is no advice (fp16
    autocast on a CPU without AVX512-FP16 measured 0.05x fp32). Strict fp32, always the last
    resort, is not listed."""
    twin = mixed_twin(name) if problem == "precision" else None  # the same range: no cure for one
    found: list[tuple[bool, int, str]] = []
    for other, spec in POLICIES.items():
        if other == name or spec.low_format or spec.compute_format == "fp32":
            continue
        if other != twin and (spec.range_format if problem == "range" else spec.rounding_format) == fmt:
            continue
        support = check_support(other, info)
        if support.supported and (support.native or other == twin):
            found.append((other != twin, spec.safety_rank, other))
    return [other for *_, other in sorted(found)]
