"""Device detection and capabilities."""

from mixprec.hardware.device import DeviceInfo, detect, resolve_device

__all__ = ["DeviceInfo", "detect", "resolve_device"]
