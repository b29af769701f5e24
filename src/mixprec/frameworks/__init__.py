"""Training frameworks underneath mixprec's one pipeline: the :class:`Framework` interface, the
registry, and the built-in backends (torch, Keras on TensorFlow).

``bench``, ``check`` and ``tune`` take any workload; :func:`framework_of` finds its backend. A new
framework is one subclass of :class:`Framework` registered with :func:`register_framework`
(``docs/architecture.md``, "Where to add a framework").
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.frameworks.base import Framework, SessionBuilder
    from mixprec.frameworks.keras.framework import KerasFramework
    from mixprec.frameworks.registry import (
        framework_named,
        framework_names,
        framework_of,
        known_framework,
        register_framework,
        unregister_framework,
    )
    from mixprec.frameworks.script.framework import ScriptFramework
    from mixprec.frameworks.torch.framework import TorchFramework

# Imported on first use (PEP 562): the script agent imports mixprec.frameworks.script.* in a training
# script's process, which needs none of the backends; the registry registers them when first asked.
_LAZY = {
    "Framework": "mixprec.frameworks.base",
    "SessionBuilder": "mixprec.frameworks.base",
    "KerasFramework": "mixprec.frameworks.keras.framework",
    "ScriptFramework": "mixprec.frameworks.script.framework",
    "TorchFramework": "mixprec.frameworks.torch.framework",
    **{
        name: "mixprec.frameworks.registry"
        for name in (
            "framework_named",
            "framework_names",
            "framework_of",
            "known_framework",
            "register_framework",
            "unregister_framework",
        )
    },
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec.frameworks' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Framework",
    "KerasFramework",
    "ScriptFramework",
    "SessionBuilder",
    "TorchFramework",
    "framework_named",
    "framework_names",
    "framework_of",
    "known_framework",
    "register_framework",
    "unregister_framework",
]
