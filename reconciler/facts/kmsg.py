"""Records of the kernel log (``/dev/kmsg``, see the kernel's
Documentation/ABI/testing/dev-kmsg) and the block devices a warning or an
error names: what tells the daemon that a device of a volume failed an I/O,
or that its filesystem gave up on writes (``EXT4-fs error``, ``Remounting
filesystem read-only``), which no mount event announces.

Pure: parsing only. A message is a reason to look at a volume again, never
a fact the planner acts on.

Imported by daemon/events.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

KERN_WARNING = 4  # syslog levels: 0 emerg ... 3 err, 4 warning, 6 info
FACILITY_KERNEL = 0  # written by the kernel itself, not by a process into /dev/kmsg

# Where kernel messages name a block device: "I/O error, dev loop3, sector",
# "Buffer I/O error on dev loop3", "EXT4-fs error (device loop3)", "EXT4-fs
# (loop3): Remounting ...", "XFS (loop3): log I/O error", "Aborting journal on
# device loop3-8", "block nbd0: Receive control failed", "rbd: rbd0: ...".
_NAMED = re.compile(r"\bdev(?:ice)? ([\w.:-]+)|\(([\w.:-]+)\)|^(?:block |rbd: )?([\w.:-]+): ")
# jbd2 names its journal "DEVICE-INODE"; dm devices are "dm-N" themselves.
_JOURNAL = re.compile(r"^(.+)-\d+$")


@dataclass(frozen=True)
class KernelMessage:
    level: int
    facility: int
    text: str

    @property
    def trouble(self) -> bool:
        """A warning or worse from the kernel itself."""
        return self.facility == FACILITY_KERNEL and self.level <= KERN_WARNING


def parse_kmsg(record: bytes) -> KernelMessage | None:
    """One record as read(2) returns it: ``PRI,SEQ,USEC,FLAGS;TEXT\\n``, then
    optional `` KEY=VALUE`` lines. None: not a record."""
    head, sep, rest = record.partition(b";")
    if not sep:
        return None
    try:
        pri = int(head.split(b",", 1)[0])
    except ValueError:
        return None
    text = rest.split(b"\n", 1)[0].decode("utf-8", errors="replace")
    return KernelMessage(level=pri & 7, facility=pri >> 3, text=text)


def devices_named(text: str) -> set[str]:
    """Block device names a message may be about (more than it is about is
    fine: only names of our devices count)."""
    out: set[str] = set()
    for m in _NAMED.finditer(text):
        name = next(g for g in m.groups() if g is not None).rstrip(".,:")
        out.add(name)
        if (j := _JOURNAL.match(name)) is not None:
            out.add(j.group(1))
    return out


def names_for_message(msg: KernelMessage, devices: Mapping[str, str]) -> set[str]:
    """The volumes whose devices a kernel warning or error names."""
    if not msg.trouble:
        return set()
    return {devices[d] for d in devices_named(msg.text) if d in devices}

