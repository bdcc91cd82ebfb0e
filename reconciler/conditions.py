"""Log a repeated condition when it starts and when it ends, not every pass.

A refused mass removal or a broken file stays true for hours; logging it at
every resync buries everything else in the journal.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable


class Conditions:
    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._active: dict[str, set[str]] = {}

    def update(self, group: str, messages: Iterable[str], level: int = logging.ERROR) -> None:
        """``messages``: every condition of ``group`` true in this pass."""
        now = set(messages)
        before = self._active.get(group, set())
        for m in sorted(now - before):
            self._log.log(level, "%s", m)
        for m in sorted(before - now):
            self._log.info("no longer: %s", m)
        self._active[group] = now

    def active(self, group: str) -> set[str]:
        return set(self._active.get(group, ()))
