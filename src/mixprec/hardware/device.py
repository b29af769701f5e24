"""What the device can do natively. Pure data: detection reads torch, nothing is changed."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch

from mixprec.errors import UsageError

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class DeviceInfo:
    """Capabilities of one device. Tests build fake ones to exercise the support gating."""

    type: str  # "cpu" or "cuda"
    name: str
    index: int | None = None
    capability: tuple[int, int] | None = None  # CUDA compute capability
    # CPU instruction-set features that decide whether low precision is fast there.
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    mkldnn_available: bool = True
    # Which fp32 ops oneDNN's bf16 math mode (bf32) really changes on this CPU: a subset of
    # ('matmul', 'conv'); None when not probed (fake devices, GPUs).
    bf32_changes: tuple[str, ...] | None = None

    @property
    def native_bf16(self) -> bool:
        """bf16 math runs in hardware, not emulated through fp32."""
        if self.type == "cuda":
            return self.capability is not None and self.capability >= (8, 0)
        return bool({"avx512_bf16", "amx_bf16"} & self.cpu_flags)

    @property
    def native_fp16(self) -> bool:
        if self.type == "cuda":
            return self.capability is not None and self.capability >= (7, 0)
        return bool({"avx512_fp16", "amx_fp16"} & self.cpu_flags)

    @property
    def tf32(self) -> bool:
        return self.type == "cuda" and self.capability is not None and self.capability >= (8, 0)

    @property
    def fp8(self) -> bool:
        return self.type == "cuda" and self.capability is not None and self.capability >= (8, 9)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["cpu_flags"] = sorted(self.cpu_flags)
        d["capability"] = list(self.capability) if self.capability else None
        d["bf32_changes"] = list(self.bf32_changes) if self.bf32_changes is not None else None
        d.update(native_bf16=self.native_bf16, native_fp16=self.native_fp16, tf32=self.tf32, fp8=self.fp8)
        return d


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means CUDA when available, else CPU. Unknown device types raise with the valid ones."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(
            f"Unknown device {device!r}; valid: {', '.join(SUPPORTED_DEVICE_TYPES)} "
            "(optionally with an index, e.g. 'cuda:1')."
        ) from exc
    if dev.type not in SUPPORTED_DEVICE_TYPES:
        raise UsageError(
            f"Device type {dev.type!r} is not supported by mixprec; valid: "
            f"{', '.join(SUPPORTED_DEVICE_TYPES)}."
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"Device {str(dev)!r} requested but CUDA is not available here "
            f"(torch {torch.__version__}); use device='cpu' (--device cpu)."
        )
    return dev


def _cpu_flags() -> frozenset[str]:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    # torch's own probes (private, hence guarded) also work where /proc/cpuinfo does not exist.
    probes = {
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_bf16": "_is_amx_tile_supported",
        "amx_fp16": "_is_amx_fp16_supported",
    }
    for flag, probe in probes.items():
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                flags.add(flag)
        except RuntimeError:
            pass
    relevant = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"}
    return frozenset(flags & relevant)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _bf32_changes() -> tuple[str, ...]:
    """Which of a 1024-wide matmul and a 3x3 convolution oneDNN computes differently under its bf16
    fp32-math mode than in strict fp32. On an AVX512-BF16 EPYC (torch 2.14) only matmuls change,
    and only large ones (1024 does, 256 does not): a CNN then runs fp32 under a bf32 label."""
    from mixprec.state import PrecisionSettings, precision_settings

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    x, w = torch.randn(2, 32, 16, 16, generator=gen), torch.randn(32, 32, 3, 3, generator=gen)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.nn.functional.linear(a, b.t()), torch.nn.functional.conv2d(x, w, padding=1)

    with torch.no_grad():
        with precision_settings(PrecisionSettings(mkldnn="ieee")):
            strict = run()
        with precision_settings(PrecisionSettings(mkldnn="bf16")):
            reduced = run()
    return tuple(
        op for op, s, r in zip(("matmul", "conv"), strict, reduced, strict=True) if not torch.equal(s, r)
    )


@lru_cache(maxsize=8)
def _detect(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return DeviceInfo(
            type="cuda",
            name=props.name,
            index=index,
            capability=(props.major, props.minor),
        )
    flags = _cpu_flags()
    mkldnn = torch.backends.mkldnn.is_available()
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    return DeviceInfo(
        type="cpu",
        name=_cpu_name(),
        cpu_flags=flags,
        mkldnn_available=mkldnn,
        bf32_changes=_bf32_changes() if mkldnn and native_bf16 else None,
    )


def detect(device: str | torch.device | None = None) -> DeviceInfo:
    """Capabilities of ``device`` (default: CUDA when available, else CPU)."""
    return _detect(resolve_device(device))
