"""What of the node looks like ours, as data: the input of ``plan/orphans.py``.

Everything a sweep for leftovers looks at (the mappings, loop and dm-crypt
devices, the rbd-fuse and rbd-nbd processes, the mounts, our nbd records
and who uses each thing), gathered by ``observe/leftovers.py`` or built by
hand in tests. Plain frozen data: nothing here reads the node.

Imported by engine/orphans.py; observe/leftovers.py; plan/orphans.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reconciler.facts.observed import Mapping, Mount

Rdev = tuple[int, int]


@dataclass(frozen=True)
class Helper:
    """An rbd-fuse or rbd-nbd process."""

    pid: int
    kind: str  # "rbd-fuse" | "rbd-nbd"
    serves: str | None  # rbd-fuse: its mount point argument; rbd-nbd: the nbd device it serves


@dataclass(frozen=True)
class LoopDev:
    path: str  # /dev/loopN
    rdev: Rdev
    back_file: str  # as sysfs says it (a FUSE file whose mount is gone: "/IMAGE")


@dataclass(frozen=True)
class CryptDev:
    """An open LUKS2 (dm-crypt) device, whatever it is over."""

    name: str  # device-mapper name
    path: str  # /dev/mapper/NAME
    rdev: Rdev
    raw: str  # the device under it, /dev/...


@dataclass(frozen=True)
class Leftovers:
    """One look at the node for a sweep. ``users``: who uses each thing
    (a mount by its mount point, a device by its path), one line each; a
    thing missing from it was not looked at, and is never removed."""

    mappings: tuple[Mapping, ...]  # fuse, krbd and nbd, as the mappers list them
    nbd_records: dict[str, tuple[str, str]]  # our nbd.json, this boot's: device -> image
    loops: tuple[LoopDev, ...]
    crypts: tuple[CryptDev, ...]
    helpers: tuple[Helper, ...]
    mounts: tuple[Mount, ...]
    rdevs: dict[str, Rdev]  # device path -> its number (mapped devices)
    users: dict[str, tuple[str, ...]] = field(default_factory=dict)
    errors: tuple[str, ...] = ()  # what could not be listed: unknown, reported
    # The cookie we recorded for each nbd device we mapped (this boot's
    # records), and each nbd device's cookie now (sysfs ``backend``): a device
    # mapped again since our record (by anyone) has another one.
    nbd_cookies: dict[str, str] = field(default_factory=dict)
    nbd_backends: dict[str, str] = field(default_factory=dict)
    # The FUSE connections alive (/sys/fs/fuse/connections: every FUSE
    # superblock, in any mount namespace, detached or not); None: not listed
    # (fusectl not mounted). One no mount we see is may be an rbd-fuse's.
    fuse_conns: frozenset[int] | None = None
