"""tune's exports offer the precision monitor as an optional line, naming an API that exists."""

from __future__ import annotations

import importlib
import re

import pytest

import mixprec


@pytest.mark.parametrize(
    ("target", "api"),
    [
        ("mixprec", "mixprec.Monitor"),
        ("pytorch", "mixprec.Monitor"),
        ("lightning", "mixprec.monitor.lightning.MonitorCallback"),
        ("hf", "mixprec.monitor.hf.MonitorCallback"),
        ("accelerate", "mixprec.monitor.accelerate.watch"),
    ],
)
def test_the_export_offers_the_monitor_and_the_api_it_names_exists(target, api):
    text = mixprec.export(mixprec.Candidate("fp16-mixed"), target, device="cuda")
    optional = [line for line in text.splitlines() if "docs/monitor.md" in line or api in line]
    assert optional and all(line.startswith("#") for line in optional)  # a comment: optional
    assert re.search(re.escape(api) + r"\(", text)
    module, name = api.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name))
