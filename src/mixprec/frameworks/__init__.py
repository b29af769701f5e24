"""Training frameworks underneath mixprec's one pipeline: the :class:`Framework` interface, the
registry, and the built-in backends (torch, Keras on TensorFlow).

``bench``, ``check`` and ``tune`` take any workload; :func:`framework_of` finds its backend. A new
framework is one subclass of :class:`Framework` registered with :func:`register_framework`
(``docs/architecture.md``, "Where to add a framework").
"""

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

register_framework(TorchFramework())
register_framework(KerasFramework())
register_framework(ScriptFramework())

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
