"""Compiling paid once per machine, not once per candidate process: Inductor's caches in mixprec's
cache directory, and what each compile cost here, so a later tune prices it from experience.

Inductor's FX-graph and AOTAutograd caches (on by default in torch >= 2.6) already let a second
process reuse a first one's compiled code; they live in ``TORCHINDUCTOR_CACHE_DIR`` (default
``/tmp/torchinductor_<user>``, which a reboot clears). mixprec points it at ``<cache>/inductor``
unless the user set it, so the artefacts last as long as the rest of mixprec's cache.

A warm compile is much cheaper than a cold one (a small bf16 MLP on a 2-core EPYC: 33.5 s cold,
2.8 s from the cache). ``compile_costs.json`` records the measured seconds per candidate so a
compile already in the cache is priced at what it cost warm, or at ``WARM_SHARE`` of its cold cost
before a warm one was timed, instead of the cold prior every run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.files import read_json_cache, write_json_cache
from mixprec.hardware.peaks import default_cache_dir

ENV = "TORCHINDUCTOR_CACHE_DIR"
# A cached compile's cost as a share of the cold one before a warm compile was timed: a prior,
# conservative against the 0.08 measured above (dynamo still traces; only codegen is skipped).
WARM_SHARE = 0.25
# Warm compiles kept per candidate: its price is their lower median. The default tune of ResNet-50 on
# the EPYC compiled bf16-mixed+cl+compile-step from the cache in 9.7 s; one later compile on a busy
# machine took 56.6 s, and, kept as the price, it kept the next quiet tune from compiling the leader.
WARM_KEPT = 5
_VERSION = 1


def _chosen(value: str) -> bool:
    """Whether ``value`` of the variable is a choice rather than torch's default: Inductor writes its
    default into the environment the first time it looks its cache up (``cache_dir()`` in
    ``torch/_inductor/runtime/cache_dir_utils.py``), so after anything compiled in this process (tune's
    strict-fp32 validation step did) an unset variable reads as set, and every compile of a tune went
    to ``/tmp/torchinductor_<user>``, which a reboot clears, beside prices kept for the next run."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default
    except ImportError:  # pragma: no cover - a torch without it: every value counts as chosen
        return True
    return os.path.abspath(value) != os.path.abspath(torch_default())


def inductor_dir() -> Path:
    """Where Inductor keeps its artefacts for this process: the user's setting, else mixprec's."""
    value = os.environ.get(ENV)
    if value and _chosen(value):
        return Path(value).expanduser()
    return (default_cache_dir() / "inductor").expanduser()


def use_inductor_cache() -> Path:
    """Point Inductor's caches at mixprec's cache directory unless the user chose another; call
    before anything compiles (Inductor reads the variable when it compiles, so a process that has
    not compiled yet, a candidate's child included, picks it up)."""
    chosen = inductor_dir()
    os.environ[ENV] = str(chosen)
    return chosen


@contextlib.contextmanager
def inductor_cache() -> Iterator[Path]:
    """:func:`use_inductor_cache` for the body only: the caller's process (its own later
    ``torch.compile``) gets its environment back as it was."""
    before = os.environ.get(ENV)
    try:
        yield use_inductor_cache()
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def _has_artefacts(path: Path) -> bool:
    try:
        return path.is_dir() and any(path.iterdir())
    except OSError:
        return False


@dataclass(frozen=True)
class Price:
    """What compiling one candidate should cost here, and why."""

    seconds: float
    basis: str


class CompileCosts:
    """The measured compile seconds per candidate on this machine (``compile_costs.json``).

    ``key`` is built by :func:`cost_key` from what a compile depends on. Never raises on a bad
    file: it reads as empty with one :class:`CacheWarning`, and a file that cannot be written is a
    warning too (the prices are a saving, not a result)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_cache_dir() / "compile_costs.json"
        self.entries = self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        good: dict[str, dict[str, Any]] = {}
        for key, entry in read_json_cache(self.path, "compile cost cache", _VERSION, "entries").items():
            if not isinstance(entry, dict):
                continue
            times: dict[str, Any] = {
                k: v for k, v in entry.items() if k in ("cold_s", "warm_s", "cut_s") and _seconds(v)
            }
            history = entry.get("warm_history")
            if isinstance(history, list) and history and all(_seconds(v) for v in history):
                times["warm_history"] = [float(v) for v in history][-WARM_KEPT:]
            elif "warm_s" in times:  # written before the history was kept
                times["warm_history"] = [times["warm_s"]]
            if "cold_s" in times or "cut_s" in times:
                good[key] = times
        return good

    def price(self, key: str) -> Price | None:
        """The price of a compile measured here before, or None (never compiled here, or Inductor's
        artefacts are gone, so it would compile cold: the caller's prior applies); one the budget
        cut off before any finished here is priced at what it had taken (:meth:`record_cut`). A warm price is
        the lower median of the warm compiles kept, so one slow compile (a busy machine) does not
        raise it and a majority does, and never more than the cold compile cost."""
        entry = self.entries.get(key)
        if entry is not None and "cold_s" not in entry:
            # never compiled to the end here: a cold compile costs at least what the budget cut off
            cut = entry["cut_s"]
            return Price(cut, f"its compile here was cut off after {cut:.0f} s")
        if entry is None or not _has_artefacts(inductor_dir()):
            return None
        if entry.get("warm_history"):
            warm = statistics.median_low(entry["warm_history"])
            if warm > entry["cold_s"]:
                # More than its cold compile did, with less to do: the machine was busy then. A price
                # the budget never pays would never be measured again to correct it.
                cold = entry["cold_s"]
                return Price(cold, f"its cold compile here took {cold:.1f} s; from the cache, {warm:.1f} s")
            return Price(warm, f"it compiled in {warm:.1f} s from the cache before")
        cold = entry["cold_s"]
        return Price(
            cold * WARM_SHARE,
            f"compiled here before in {cold:.1f} s; its artefacts are in {inductor_dir()}",
        )

    def cold_s(self, key: str) -> float | None:
        """What the first compile of ``key`` cost here (compiling it cold), or None: at least what
        a compile the budget cut off had taken (the one that then finished read the artefacts the
        cut ones left: the default ResNet-50 tune on the EPYC had its step's compile cut off after
        ~75 s twice, then compiled it in 21 s)."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        return max(entry.get("cold_s", 0.0), entry.get("cut_s", 0.0))

    def record_cut(self, key: str, seconds: float) -> None:
        """A compile of ``key`` the budget stopped after ``seconds``, before any finished here: a
        cold compile costs at least that (:meth:`price`). Without it the next tune priced it at the
        cold prior again and spent the same ~75 s of its 300 on it, to the same end. Once one has
        finished, what it cost prices it from the cache; the cut one still bounds a compile with
        the artefacts gone (:meth:`cold_s`), and no later cut is kept."""
        if not _seconds(seconds):
            return
        entry = self.entries.setdefault(key, {})
        if "cold_s" in entry:
            return
        entry["cut_s"] = max(float(seconds), entry.get("cut_s", 0.0))
        self._save()

    def record(self, key: str, seconds: float) -> None:
        """Keep what this compile cost: the first time as its cold cost, later ones as warm (the
        last :data:`WARM_KEPT`; :meth:`price` takes their lower median)."""
        if not _seconds(seconds):
            return
        entry = self.entries.setdefault(key, {})
        if "cold_s" not in entry:
            entry["cold_s"] = float(seconds)
        else:
            entry["warm_history"] = [*entry.get("warm_history", []), float(seconds)][-WARM_KEPT:]
            entry["warm_s"] = float(seconds)  # the latest, for a reader from before the history
        self._save()

    def _save(self) -> None:
        write_json_cache(self.path, "compile cost cache", _VERSION, "entries", self.entries, "compile costs")


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e6


def cost_key(framework: str, workload: str, batch_size: int, label: str, device: str, threads: int) -> str:
    """What a compile's cost depends on: the code compiled (framework, workload, candidate, batch),
    the machine (device name, the threads it compiles and runs at) and the compiler (torch's version)."""
    parts = [framework, workload, str(batch_size), label, device, str(threads), torch.__version__]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]
