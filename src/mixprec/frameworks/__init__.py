"""Training frameworks underneath mixprec's one pipeline: the :class:`Framework` interface, the
registry, and the built-in backends (torch, Keras on TensorFlow).

``bench``, ``check`` and ``tune`` take any workload; :func:`framework_of` finds its backend. A new
framework is one subclass of :class:`Framework` registered with :func:`register_framework`
(``docs/architecture.md``, "Where to add a framework").
"""

from typing import TYPE_CHECKING

from mixprec.frameworks.base import Framework, SessionBuilder
from mixprec.frameworks.registry import (
    framework_named,
    framework_names,
    framework_of,
    known_framework,
    register_framework,
    unregister_framework,
)
from mixprec.lazy import lazy_names

if TYPE_CHECKING:
    from mixprec.frameworks.keras.framework import KerasFramework
    from mixprec.frameworks.script.framework import ScriptFramework
    from mixprec.frameworks.torch.framework import TorchFramework

# The backends are imported on first use: the script agent imports mixprec.frameworks.script.* in a
# training script's process, which needs none of them; the registry registers them when first asked.
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "KerasFramework": "mixprec.frameworks.keras.framework",
        "ScriptFramework": "mixprec.frameworks.script.framework",
        "TorchFramework": "mixprec.frameworks.torch.framework",
    },
)

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
