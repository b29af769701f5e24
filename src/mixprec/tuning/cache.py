"""`autotune`: tune once, then read the decision from a cache file.

The cache is ``{"schema_version": 2, "entries": {key: {"candidate": ..., ...}}}``: the whole pick
(policy, layout, islands, compile mode and scope, optimizer implementation, micro-batch), not only
its policy. It is validated on read: a file that is missing is a miss; one that cannot be read (a
directory, binary, not JSON, another schema) or an entry that does not rebuild a candidate is a miss
plus one :class:`~mixprec.errors.CacheWarning`. A cache that cannot be written is a warning too:
the tune's decision is still returned.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import CacheWarning, MixprecError, UsageError
from mixprec.files import atomic_write_text, read_json_cache
from mixprec.hardware.device import detect, resolve_device
from mixprec.policy import Candidate, get_policy
from mixprec.tuning.config import TuneConfig
from mixprec.tuning.run import tune
from mixprec.tuning.tuned import Tuned
from mixprec.workload import Workload

CACHE_SCHEMA_VERSION = 2  # 1 held only the policy: its compile, optimizer and micro-batch were lost


def _cache_file() -> Path:
    return Path(os.environ.get("MIXPREC_CACHE_DIR", "~/.cache/mixprec")).expanduser() / "autotune.json"


def autotune_key(
    workload: Workload, device: torch.device, batch_size: int | None, options: Mapping[str, Any] | None = None
) -> str:
    """What the decision depends on: the model's shapes, the device, the batch, the versions, and
    the settings the tune ``options`` make where they differ from tune's defaults (a pick made with
    a 30 s budget is not the answer to a 600 s one; a default tune keeps the key it always had)."""
    from mixprec.version import __version__

    shapes = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in workload.model.named_parameters())
    payload = [
        str(workload.name),
        str(workload.spec.to_dict() if workload.spec else None),
        hashlib.sha256(shapes.encode()).hexdigest()[:16],
        detect(device).name,
        str(batch_size or workload.default_batch_size),
        torch.__version__,
        __version__,
    ]
    # tune's keywords and a config alike, as the settings they make (events, stop and interrupt
    # decide nothing)
    fields = {k: v for k, v in (options or {}).items() if k not in ("config", "events", "stop", "interrupt")}
    settings = ((options or {}).get("config") or TuneConfig()).with_fields(**fields).to_dict()
    default = TuneConfig().to_dict()
    if changed := {k: v for k, v in settings.items() if v != default[k]}:
        payload.append(json.dumps(changed, sort_keys=True, default=str))
    return hashlib.sha256("|".join(payload).encode()).hexdigest()[:24]


def _valid_entry(entry: Any) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("candidate"), dict):
        return False
    try:
        Candidate.from_dict(entry["candidate"])
    except (MixprecError, TypeError, KeyError, ValueError, AttributeError):
        return False
    return True


def read_cache(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The valid entries of the cache file at ``path``; never raises (see the module docstring)."""
    path = Path(path)
    entries = read_json_cache(
        path,
        "autotune cache",
        CACHE_SCHEMA_VERSION,
        "entries",
        version_key="schema_version",
        then="tuning again and replacing it",
    )
    good = {k: v for k, v in entries.items() if isinstance(k, str) and _valid_entry(v)}
    if len(good) < len(entries):
        warnings.warn(
            f"autotune cache {str(path)!r}: {len(entries) - len(good)} invalid entries ignored.",
            CacheWarning,
            3,
        )
    return good


def write_cache(path: str | os.PathLike[str], entries: dict[str, dict[str, Any]]) -> bool:
    """Replace the cache file atomically; False (and a warning) when it cannot be written."""
    text = json.dumps({"schema_version": CACHE_SCHEMA_VERSION, "entries": entries}, indent=2)
    try:
        atomic_write_text(path, text + "\n", "autotune cache")
    except MixprecError as exc:
        warnings.warn(f"{exc} The decision is not cached.", CacheWarning, 3)
        return False
    return True


def autotune(
    workload: Workload,
    *,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    cache_path: str | Path | None = None,
    refresh: bool = False,
    **tune_options: Any,
) -> Tuned:
    """The candidate tune recommends for ``workload``, whole, tuned once and then read from a cache
    file: a :class:`~mixprec.tuning.tuned.Tuned` whose ``prepare``, ``optimizer`` and
    ``compile_step`` apply its compile mode and optimizer implementation as they were measured, with
    its ``policy`` and micro-batch.

    The cache (``~/.cache/mixprec/autotune.json`` or ``$MIXPREC_CACHE_DIR``) is keyed by the
    model's parameter shapes, the device, the batch size, the torch/mixprec versions and the
    ``tune_options`` (:func:`autotune_key`), so a changed model, machine or tune is tuned again.
    ``refresh=True`` ignores the cached decision. A pick the budget cut short (tune's exit 5: strict
    fp32 where a lower precision went unmeasured or unchecked) is returned, not cached: the next
    call, on a quieter machine or with a larger budget, tunes again.
    A cache that cannot be read or written is a miss with a :class:`~mixprec.errors.CacheWarning`.
    ``tune_options`` go to :func:`mixprec.tune` (e.g. ``budget_s``).
    """
    if not isinstance(workload, Workload):
        raise UsageError(
            f"autotune() returns a torch training configuration and takes a mixprec.Workload, got "
            f"{type(workload).__name__}; use mixprec.tune() for other frameworks."
        )
    dev = resolve_device(device)
    path = Path(cache_path) if cache_path else _cache_file()
    key = autotune_key(workload, dev, batch_size, tune_options)
    cache = read_cache(path)
    if not refresh and key in cache:
        entry = cache[key]
        candidate = Candidate.from_dict(entry["candidate"])
        return Tuned(candidate, get_policy(candidate, device=dev), str(entry.get("reason", "")))
    result = tune(workload, device=dev, batch_size=batch_size, **tune_options)
    rec = result.recommendation
    candidate = rec.candidate if rec else Candidate("fp32")
    policy = get_policy(candidate, device=dev)
    reason = rec.reason if rec else "nothing passed: fp32"
    if cut := result.budget_exhausted or result.interrupted:  # today's answer, not the decision
        return Tuned(candidate, policy, f"{reason} (not cached: {cut})")
    cache[key] = {
        "candidate": candidate.to_dict(),
        "label": candidate.label,
        "config": policy.config.to_dict(),
        "workload": result.workload,
        "reason": reason,
        "created": result.created,
    }
    write_cache(path, cache)
    return Tuned(candidate, policy, reason)
