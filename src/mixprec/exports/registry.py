"""The one vocabulary of export targets: the seven that write training code or configuration around
the user's model (:data:`EXPORT_TARGETS`) and the five that write a low-format policy's precision
map with the model's Linear names (:data:`MAP_TARGETS`), every name and alias meaning one target.
``accelerate`` is the Accelerate training script; the Accelerate precision map is
``accelerate-fp8``."""

from __future__ import annotations

from mixprec.errors import UsageError, did_you_mean
from mixprec.exports.accelerate import AccelerateTarget
from mixprec.exports.deepspeed import DeepSpeedTarget
from mixprec.exports.fsdp2 import FSDP2Target
from mixprec.exports.hf import HFTarget
from mixprec.exports.lightning import LightningTarget
from mixprec.exports.maps.accelerate import AccelerateFp8Map
from mixprec.exports.maps.megatron import MegatronMap
from mixprec.exports.maps.target import map_family
from mixprec.exports.maps.torchao import TorchaoMap
from mixprec.exports.maps.torchtitan import TorchtitanMap
from mixprec.exports.maps.transformer_engine import TransformerEngineMap
from mixprec.exports.native import MixprecTarget
from mixprec.exports.pytorch import PyTorchTarget
from mixprec.exports.target import ExportTarget

TARGETS: dict[str, ExportTarget] = {
    target.name: target
    for target in (
        MixprecTarget(),
        PyTorchTarget(),
        LightningTarget(),
        AccelerateTarget(),
        DeepSpeedTarget(),
        FSDP2Target(),
        HFTarget(),
    )
}
MAPS: dict[str, ExportTarget] = {
    target.name: target
    for target in map_family(TorchaoMap, TorchtitanMap, AccelerateFp8Map, MegatronMap, TransformerEngineMap)
}
ALL_TARGETS: dict[str, ExportTarget] = {**TARGETS, **MAPS}
EXPORT_TARGETS: tuple[str, ...] = tuple(TARGETS)
MAP_TARGETS: tuple[str, ...] = tuple(MAPS)
ALIASES: dict[str, str] = {alias: t.name for t in ALL_TARGETS.values() for alias in t.aliases}


def check_target(target: str) -> ExportTarget:
    """The target named ``target`` (a name or an alias, any case), or one :class:`UsageError` that
    lists every valid name, the precision-map targets apart, with the closest one."""
    key = target.strip().lower() if isinstance(target, str) else target
    key = ALIASES.get(key, key)
    if key not in ALL_TARGETS:
        raise UsageError(
            f"Unknown export target {target!r}; valid: {', '.join(EXPORT_TARGETS)}; the precision-map "
            f"targets (with model=): {', '.join(MAP_TARGETS)}.{did_you_mean(str(target), ALL_TARGETS)}"
        )
    return ALL_TARGETS[key]
