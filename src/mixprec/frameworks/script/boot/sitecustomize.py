"""mixprec's hook into a training script's process: first on the child's PYTHONPATH, Python imports
it at start-up (``site``), before the script. It runs the interpreter's own sitecustomize, which it
shadows, then installs mixprec's agent where the parent left a plan (mixprec.frameworks.script)."""

import os
import sys


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and spec.origin != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
if os.environ.get("MIXPREC_SCRIPT_PLAN"):
    from mixprec.frameworks.script.agent import install_from_env

    install_from_env()
