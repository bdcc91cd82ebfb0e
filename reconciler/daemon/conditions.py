"""Log a repeated condition when it starts and when it ends, not every pass.

A refused mass removal or a broken file stays true for hours; logging it at
every resync buries everything else in the journal.

Imported by daemon/passes.py, daemon/service.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping


class Conditions:
    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._active: dict[str, dict[str, str]] = {}

    def update(self, group: str, messages: Iterable[str] | Mapping[str, str],
               level: int = logging.ERROR) -> None:
        """Every condition of ``group`` true in this pass: messages, or
        key -> message where the key alone says whether it is the same
        condition (a reason that varies while it lasts is not logged again)."""
        now = dict(messages) if isinstance(messages, Mapping) else {m: m for m in messages}
        before = self._active.get(group, {})
        for key in sorted(now.keys() - before.keys()):
            self._log.log(level, "%s", now[key])
        for key in sorted(before.keys() - now.keys()):
            self._log.info("no longer: %s", before[key])
        self._active[group] = {k: before.get(k, now[k]) for k in now}

    def active(self, group: str) -> dict[str, str]:
        return dict(self._active.get(group, {}))
