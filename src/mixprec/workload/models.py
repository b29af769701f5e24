"""Models by name: the one place that parses ``--model``.

A name is a built-in (``resnet50``, ``gpt2``, ``mlp``, ...) or ``SOURCE:NAME`` with a source
from :data:`SOURCES`: ``torchvision:efficientnet_b0``, ``timm:convnext_atto``, ``hf:bert``. A
source is a :class:`ModelSource`; another framework plugs in with :func:`register_source`.
``--model-config key=value,...`` is parsed here too (:func:`parse_model_config`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mixprec.errors import UsageError, did_you_mean
from mixprec.workload import text, vision
from mixprec.workload.workload import Workload
from mixprec.workload.zoo import ZOO_NAMES


@dataclass(frozen=True)
class ModelSource:
    """Where models by name come from, and how one is built.

    ``build(name, options)`` returns the workload; ``options`` are ``image_size`` / ``seq_len``
    and the ``--model-config`` overrides. ``available()`` says whether the library is installed;
    ``extra`` is the mixprec extra that installs it. ``preload`` are modules a child process
    should import before it is forked (they are slow to import).
    """

    prefix: str
    title: str
    names: Callable[[], Sequence[str]]
    build: Callable[[str, dict[str, Any]], Workload]
    available: Callable[[], bool] = lambda: True
    extra: str | None = None
    preload: tuple[str, ...] = ()
    sizes: tuple[str, ...] = ()  # the size options that apply: image_size, seq_len

    def missing(self) -> str:
        """The one-line reason this source cannot be used here ('' when it can)."""
        if self.available():
            return ""
        install = f"pip install 'mixprec[{self.extra}]'" if self.extra else "install it"
        return f"{self.title} is not installed: {install}"


SOURCES: dict[str, ModelSource] = {
    s.prefix: s
    for s in (
        ModelSource(
            "torchvision",
            "torchvision image classifiers",
            vision.torchvision_names,
            vision.build_torchvision,
            sizes=("image_size",),
        ),
        ModelSource(
            "timm",
            "timm (pytorch-image-models)",
            vision.timm_names,
            vision.build_timm,
            available=vision.timm_available,
            extra="timm",
            preload=("timm",),
            sizes=("image_size",),
        ),
        ModelSource(
            "hf",
            "Hugging Face transformers",
            text.hf_names,
            text.build_hf,
            available=text.transformers_available,
            extra="hf",
            preload=("transformers",),
            sizes=("seq_len",),
        ),
    )
}


def register_source(source: ModelSource) -> None:
    """Make ``SOURCE:NAME`` models of another library (or framework) loadable by name."""
    if not source.prefix.isidentifier():
        raise UsageError(f"model source prefix {source.prefix!r} must be an identifier, e.g. 'keras'.")
    SOURCES[source.prefix] = source


def is_model_name(target: str) -> bool:
    """Whether ``target`` is ``SOURCE:NAME`` for a registered source (not 'module:function')."""
    prefix, sep, _ = target.partition(":")
    return bool(sep) and prefix in SOURCES


def source_of(target: str) -> ModelSource | None:
    prefix, sep, _ = target.partition(":")
    return SOURCES.get(prefix) if sep else None


def build_named(target: str, options: dict[str, Any]) -> Workload:
    """Build ``SOURCE:NAME`` with ``options``; every bad part fails with the valid alternatives."""
    prefix, _, name = target.partition(":")
    source = SOURCES.get(prefix)
    if source is None:
        raise UsageError(
            f"unknown model source {prefix!r} in {target!r}; valid: {', '.join(SOURCES)}."
            + did_you_mean(prefix, list(SOURCES))
        )
    reason = source.missing()
    if reason:
        raise UsageError(f"--model {target}: {reason}.")
    names = list(source.names())
    if name not in names:
        raise UsageError(
            f"unknown {source.prefix} model {name!r}.{vision.close_matches(name, names)} "
            f"`mixprec bench --list-models '{source.prefix}:*'` lists all {len(names)}."
        )
    for size in ("image_size", "seq_len"):
        if size in options and size not in source.sizes:
            other = ", ".join(f"--{s.replace('_', '-')}" for s in source.sizes) or "none"
            raise UsageError(
                f"{size}={options[size]!r} does not apply to {target}; its size options: {other}."
            )
    return source.build(name, dict(options))


def preload_modules(target: str) -> tuple[str, ...]:
    source = source_of(target)
    return source.preload if source is not None and not source.missing() else ()


@dataclass(frozen=True)
class SourceListing:
    """What ``--list-models`` shows for one source."""

    prefix: str
    title: str
    missing: str  # why it is unavailable ('' when installed)
    names: tuple[str, ...]  # matching the pattern
    total: int  # names the source has


def list_models(pattern: str | None = None) -> list[SourceListing]:
    """The models loadable by name here, per source (built-ins first), those matching the glob
    ``pattern`` (matched against ``NAME`` and ``SOURCE:NAME``; None for all)."""

    def matching(prefix: str, names: Sequence[str]) -> tuple[str, ...]:
        if not pattern:
            return tuple(names)
        return tuple(
            n
            for n in names
            if fnmatch.fnmatch(n, pattern) or (prefix and fnmatch.fnmatch(f"{prefix}:{n}", pattern))
        )

    listings = [SourceListing("", "built-in", "", matching("", ZOO_NAMES), len(ZOO_NAMES))]
    for source in SOURCES.values():
        missing = source.missing()
        names = [] if missing else list(source.names())
        found = matching(source.prefix, names)
        listings.append(SourceListing(source.prefix, source.title, missing, found, len(names)))
    return listings


def parse_model_config(text: str | None) -> dict[str, Any]:
    """``'n_layer=2,n_embd=128,task=masked-lm'`` -> ``{'n_layer': 2, 'n_embd': 128, 'task':
    'masked-lm'}``; values become int, float, bool (true/false), None (none) or stay strings."""
    if text is None or not text.strip():
        return {}
    config: dict[str, Any] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier() or not value:
            raise UsageError(
                f"--model-config item {item!r} is not key=value; pass e.g. "
                "--model-config n_layer=2,n_embd=128 (comma-separated, no spaces needed)."
            )
        if key in config:
            raise UsageError(f"--model-config sets {key!r} twice; keep one.")
        config[key] = _value(value)
    return config


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            continue
    return text
