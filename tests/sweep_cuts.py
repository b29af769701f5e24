"""Tests that stop a real speed sweep part-way, as a deadline would (no timing: by the candidate it
has reached)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any


def cut_at_candidate(kwargs: dict[str, Any], n: int) -> dict[str, Any]:
    """``run_sweep``'s keyword arguments with its budget stopped once the sweep starts its ``n``-th
    candidate (the ``n - 1`` before it measured), its events still forwarded."""
    started: list[str] = []
    forward = kwargs["events"]

    def events(event: dict[str, Any]) -> None:
        if event["event"] == "candidate":
            started.append(event["label"])
        forward(event)

    budget = replace(kwargs["budget"], stop=lambda: len(started) >= n)
    return {**kwargs, "events": events, "budget": budget}
