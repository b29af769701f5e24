"""Imported by the candidates' fork server before it forks any child.

The slow imports a workload needs (transformers, timm: seconds each) are named in
``MIXPREC_PRELOAD`` by the sweep (``Framework.preload``; :mod:`mixprec.measure.isolate`) and
imported here once, so every candidate's child starts with them loaded. Whatever they print
while importing is dropped: the parent process, which imported them too, has already shown it.
"""

from __future__ import annotations

import contextlib
import importlib
import os

from mixprec.workload.output import captured_fds

ENV = "MIXPREC_PRELOAD"

for _name in filter(None, os.environ.get(ENV, "").split(",")):
    # A module that fails here is imported (and its error reported) in the child that needs it.
    with captured_fds(), contextlib.suppress(Exception):
        importlib.import_module(_name)
