"""A monotonic clock a test moves by hand (``clock.now += s``)."""

from __future__ import annotations

import pytest

from reconciler.csi import records as records_mod


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def moved_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """records.py's monotonic clock, replaced by one the test moves."""
    c = Clock()
    monkeypatch.setattr(records_mod.time, "monotonic", c)
    return c
