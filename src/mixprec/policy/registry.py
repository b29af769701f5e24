"""The closed vocabulary of precision policies: one definition used by the API, the CLI and JSON."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mixprec.errors import PolicyError, did_you_mean
from mixprec.hardware.device import DeviceInfo
from mixprec.state import PrecisionSettings

_STRICT = PrecisionSettings(cuda_matmul="ieee", cudnn="ieee", mkldnn="ieee")


@dataclass(frozen=True)
class PolicySpec:
    """What a policy name means. ``autocast_dtype`` and ``param_dtype`` are mutually exclusive."""

    name: str
    description: str
    precision: PrecisionSettings
    autocast_dtype: torch.dtype | None = None  # *-mixed: fp32 weights, autocast compute
    param_dtype: torch.dtype | None = None  # *-true: weights stored in half precision
    loss_scaling: bool = False

    @property
    def low_precision_dtype(self) -> torch.dtype | None:
        return self.autocast_dtype or self.param_dtype

    @property
    def is_mixed(self) -> bool:
        return self.autocast_dtype is not None


POLICIES: dict[str, PolicySpec] = {
    spec.name: spec
    for spec in (
        PolicySpec(
            "fp32",
            "fp32 storage and strict IEEE fp32 math (TF32 off for matmul and cuDNN conv)",
            _STRICT,
        ),
        PolicySpec(
            "tf32",
            "fp32 storage, TF32 tensor cores for matmul and convolution",
            PrecisionSettings(cuda_matmul="tf32", cudnn="tf32", mkldnn="ieee"),
        ),
        PolicySpec(
            "bf32",
            "fp32 storage, oneDNN matmul/conv with bf16 internals (CPU)",
            PrecisionSettings(cuda_matmul="ieee", cudnn="ieee", mkldnn="bf16"),
        ),
        PolicySpec(
            "bf16-mixed",
            "fp32 weights, autocast to bf16, optional finite-gradient guard",
            _STRICT,
            autocast_dtype=torch.bfloat16,
        ),
        PolicySpec(
            "fp16-mixed",
            "fp32 weights, autocast to fp16, dynamic loss scaling",
            _STRICT,
            autocast_dtype=torch.float16,
            loss_scaling=True,
        ),
        PolicySpec(
            "bf16-true",
            "bf16 weights and math, no fp32 master weights",
            _STRICT,
            param_dtype=torch.bfloat16,
        ),
        PolicySpec(
            "fp16-true",
            "fp16 weights and math, no fp32 master weights, dynamic loss scaling",
            _STRICT,
            param_dtype=torch.float16,
            loss_scaling=True,
        ),
    )
}

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)

# Short names and Lightning's precision strings, so configs can be pasted between tools.
ALIASES: dict[str, str] = {
    "fp16": "fp16-mixed",
    "bf16": "bf16-mixed",
    "32-true": "fp32",
    "32": "fp32",
    "16-mixed": "fp16-mixed",
    "16-true": "fp16-true",
}


def canonical_name(name: str) -> str:
    """The canonical policy name for ``name`` or an alias; raises :class:`PolicyError` otherwise."""
    if not isinstance(name, str):
        raise PolicyError(
            f"Policy name must be a string, got {type(name).__name__} {name!r}; "
            f"valid: {', '.join(POLICY_NAMES)}."
        )
    key = name.strip().lower()
    if key in POLICIES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    raise PolicyError(
        f"Unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)} "
        f"(aliases: {', '.join(ALIASES)}).{did_you_mean(key, [*POLICY_NAMES, *ALIASES])}"
    )


@dataclass(frozen=True)
class Support:
    """Whether a policy can run on a device, why, and what to use instead."""

    supported: bool
    reason: str
    suggestion: str | None = None

    def __bool__(self) -> bool:
        return self.supported


# What to suggest instead of a policy that is unsupported (or slow) here: the first of these
# that runs natively on the device. fp32 always does, so every chain ends there.
_FALLBACKS: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "tf32": ("bf32", "bf16-mixed", "fp16-mixed", "fp32"),
    "bf32": ("tf32", "bf16-mixed", "fp32"),
    "bf16-mixed": ("fp16-mixed", "tf32", "bf32", "fp32"),
    "fp16-mixed": ("bf16-mixed", "tf32", "bf32", "fp32"),
    "bf16-true": ("fp16-mixed", "bf16-mixed", "fp32"),
    "fp16-true": ("bf16-mixed", "bf16-true", "fp32"),
}


def _assess(spec: PolicySpec, info: DeviceInfo) -> tuple[bool, bool, str]:
    """(supported, fast, reason) without suggestions: 'fast' means native, not emulated."""
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
    if spec.name == "bf32":
        if info.type != "cpu":
            return False, False, "bf32 is a oneDNN (CPU) math mode; cuBLAS has no bf16 fp32-mode"
        if not info.mkldnn_available:
            return False, False, "this torch build has no oneDNN (mkldnn)"
        if not info.native_bf16:
            return False, False, "bf32 needs AVX512-BF16 or AMX on the CPU; this CPU has neither"
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


def check_support(name: str, info: DeviceInfo) -> Support:
    """Support of policy ``name`` on the device described by ``info``. Never raises for known names.

    Where the policy is unsupported or only emulated, ``suggestion`` names the first policy
    of its fallback chain that runs natively on this device.
    """
    spec = POLICIES[canonical_name(name)]
    if info.type not in ("cpu", "cuda"):
        return Support(False, f"device type {info.type!r} is not supported", "fp32 on cpu or cuda")
    supported, fast, reason = _assess(spec, info)
    if fast:
        return Support(supported, reason)
    suggestion = next(
        (alt for alt in _FALLBACKS[spec.name] if _assess(POLICIES[alt], info)[1]),
        "fp32",
    )
    return Support(supported, reason, suggestion)
