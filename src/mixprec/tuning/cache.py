"""`autotune`: tune once, then read the decision from a cache file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from mixprec.hardware.device import detect, resolve_device
from mixprec.policy import Policy, get_policy, policy_from_config
from mixprec.tuning.search import tune
from mixprec.workload import Workload


def _cache_file() -> Path:
    return Path(os.environ.get("MIXPREC_CACHE_DIR", "~/.cache/mixprec")).expanduser() / "autotune.json"


def autotune_key(workload: Workload, device: torch.device, batch_size: int | None) -> str:
    """What the decision depends on: the model's shapes, the device, the batch, the versions."""
    from mixprec import __version__

    shapes = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in workload.model.named_parameters())
    payload = "|".join(
        [
            str(workload.name),
            str(workload.spec.to_dict() if workload.spec else None),
            hashlib.sha256(shapes.encode()).hexdigest()[:16],
            detect(device).name,
            str(batch_size or workload.default_batch_size),
            torch.__version__,
            __version__,
        ]
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def autotune(
    workload: Workload,
    *,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    cache_path: str | Path | None = None,
    refresh: bool = False,
    **tune_options: Any,
) -> Policy:
    """The recommended policy for ``workload``, tuned once and then read from a cache file.

    The cache (``~/.cache/mixprec/autotune.json`` or ``$MIXPREC_CACHE_DIR``) is keyed by the
    model's parameter shapes, the device, the batch size and the torch/mixprec versions, so a
    changed model or machine is tuned again. ``refresh=True`` ignores the cached decision.
    ``tune_options`` go to :func:`mixprec.tune` (e.g. ``budget_s``).
    """
    dev = resolve_device(device)
    path = Path(cache_path) if cache_path else _cache_file()
    key = autotune_key(workload, dev, batch_size)
    try:
        cache = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        cache = {}  # a corrupt cache is a miss, not an error
    if not refresh and key in cache:
        return policy_from_config(cache[key]["config"])
    result = tune(workload, device=dev, batch_size=batch_size, **tune_options)
    rec = result.recommendation
    config = rec.config(str(dev)) if rec else get_policy("fp32", device=dev).config
    cache[key] = {
        "config": config.to_dict(),
        "workload": result.workload,
        "reason": rec.reason if rec else "nothing passed: fp32",
        "created": result.created,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=2), encoding="utf-8")
    tmp.replace(path)
    return policy_from_config(config)
