"""Tests of an optional extra (timm, hf) skip with the reason when it is missing, and fail instead
when MIXPREC_REQUIRE_FRAMEWORKS=1 (``make test`` sets it: there every extra is installed)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(package: str, extra: str) -> ModuleType:
    if os.environ.get("MIXPREC_REQUIRE_FRAMEWORKS") == "1":
        return importlib.import_module(package)
    return pytest.importorskip(
        package, reason=f"{package} is not installed: pip install -e '.[{extra}]' (make test does)"
    )
