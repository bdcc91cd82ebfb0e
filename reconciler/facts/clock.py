"""Timestamps as the status files, the conditions and the source's records
write them: ISO 8601, UTC, milliseconds (one format, so they sort and
compare as text)."""

from __future__ import annotations

from datetime import UTC, datetime


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
