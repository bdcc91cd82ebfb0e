"""Timestamps as the status files, the conditions and the source's records
write them: ISO 8601, UTC, milliseconds (one format, so they sort and
compare as text).

Imported by daemon/outcomes.py, daemon/rollout.py, daemon/service.py;
source/sync.py, source/trust.py.
"""

from __future__ import annotations

from datetime import UTC, datetime


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
