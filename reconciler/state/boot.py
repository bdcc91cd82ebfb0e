"""This boot, for the records that last only as long as it (a mapping, a
freeze): each carries the boot's id, and a record of another boot describes
nothing that is still there (a reboot unmapped and thawed everything).

Imported by drivers/freeze.py; state/registry.py.
"""

from __future__ import annotations

import time
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID) -> str | None:
    """The kernel's random id of this boot; None where it cannot be read
    (then every record is taken for this boot's, as before there were ids)."""
    try:
        return path.read_text().strip() or None
    except (OSError, ValueError):
        return None


def started() -> float:
    """When this boot began, in seconds since the epoch."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def of_another_boot(recorded: object, now: str | None) -> bool:
    """A record's boot id (None: written before records carried one) against
    this boot's: only a different id proves another boot."""
    return isinstance(recorded, str) and now is not None and recorded != now
