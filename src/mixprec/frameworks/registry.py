"""The frameworks mixprec knows, by name: ``--framework NAME``, ``Candidate.framework`` and the
backend of a workload all resolve here. The built-in backends (torch, Keras, the user's script) are
registered the first time the registry is asked (:func:`_builtins`); another backend registers
itself with :func:`register_framework`."""

from __future__ import annotations

from typing import Any

from mixprec.errors import UsageError, did_you_mean
from mixprec.frameworks.base import Framework, check_name

_FRAMEWORKS: dict[str, Framework] = {}
_BUILTINS = [False]  # whether the built-in backends are registered


def _builtins() -> None:
    """Register the built-in backends, once, before anything else is looked up or registered."""
    if _BUILTINS[0]:
        return
    _BUILTINS[0] = True
    from mixprec.frameworks.keras.framework import KerasFramework
    from mixprec.frameworks.script.framework import ScriptFramework
    from mixprec.frameworks.torch.framework import TorchFramework

    for framework in (TorchFramework(), KerasFramework(), ScriptFramework()):
        register_framework(framework)


def register_framework(framework: Framework) -> Framework:
    """Make ``framework`` available under its ``name`` (replacing one of the same name); returns it."""
    _builtins()
    if not isinstance(framework, Framework):
        raise UsageError(
            "register_framework() takes a mixprec.frameworks.Framework instance, got "
            f"{type(framework).__name__}."
        )
    _FRAMEWORKS[check_name(framework.name)] = framework
    return framework


def unregister_framework(name: str) -> None:
    """Forget the framework ``name`` (tests register toy backends and remove them again)."""
    _builtins()
    _FRAMEWORKS.pop(name, None)


def framework_names() -> tuple[str, ...]:
    """The frameworks ``--framework`` may name (a source entered otherwise, a script after ``--``,
    is not one of them)."""
    _builtins()
    return tuple(name for name, f in _FRAMEWORKS.items() if f.named)


def framework_named(name: str) -> Framework:
    """The framework registered as ``name``; a :class:`UsageError` listing the known ones otherwise."""
    _builtins()
    try:
        return _FRAMEWORKS[name]
    except (KeyError, TypeError):
        names = ", ".join(_FRAMEWORKS)
        raise UsageError(
            f"Unknown framework {name!r}; valid: {names}.{did_you_mean(str(name), list(_FRAMEWORKS))}"
        ) from None


def known_framework(name: str) -> Framework | None:
    """The framework registered as ``name``, or None (e.g. a result file of a backend not loaded)."""
    _builtins()
    return _FRAMEWORKS.get(name)


def framework_of(workload: Any) -> Framework:
    """The backend that owns ``workload`` (a :class:`mixprec.Workload`, a Keras workload, ...)."""
    _builtins()
    for framework in _FRAMEWORKS.values():
        if framework.owns(workload):
            return framework
    kinds = ", ".join(f.workload_name for f in _FRAMEWORKS.values())
    raise UsageError(
        f"{type(workload).__name__} is no workload mixprec can train; pass one of: {kinds} "
        "(e.g. mixprec.load_workload('resnet50'))."
    )
