"""Device probes for observe: no fork where a mount already proves the
content, and a probe kept across daemon passes while the device is unchanged.

For observing only: apply re-probes (blkid) right before any mkfs.

Imported by observe/node.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from reconciler.drivers.fs import Filesystems, fs_size_from, read_head, read_superblock
from reconciler.facts import luks
from reconciler.facts.parsers import parse_superblock


@dataclass(frozen=True)
class Probed:
    fs_type: str | None
    uuid: str | None
    signature: str | None
    fs_size: int | None
    luks_offset: int | None = None  # a LUKS2 header: where its data starts


# (major, minor, size, digest of the first 64 KiB): mkfs, wipefs or a
# partition table rewrite write the start of the device, a remap or resize
# changes the rest. A signature written only at the end is caught by the
# age limit (and by apply's own blkid before any mkfs).
CacheKey = tuple[int, int, int, bytes]


def written(major: int, minor: int, sys_root: Path = Path("/sys")) -> tuple[str, ...]:
    """The device's write and discard counters (sysfs ``stat``: writes
    completed, merged, sectors; discards completed, merged, sectors).
    OSError when the kernel does not keep them (``queue/iostats`` 0: they
    never move, whatever is written)."""
    block = sys_root / "dev" / "block" / f"{major}:{minor}"
    if (block / "queue" / "iostats").read_text().strip() != "1":
        raise OSError(f"{major}:{minor}: I/O accounting is off")
    fields = (block / "stat").read_text().split()
    return (*fields[4:7], *fields[11:14])


@dataclass
class _Entry:
    key: CacheKey
    probed: Probed
    at: float
    written: tuple[str, ...] | None  # the counters when its start was read
    # What the device was mapped for (kind, pool, image) when probed: a
    # device number is reused by the next map (krbd's lowest free id; nbd
    # and loop devices persist, counters and all), maybe in one daemon pass.
    owner: str | None = None


class ProbeCache:
    """Probes of unmounted devices, per path, for the daemon's Node. A
    device nothing was written to since (the kernel's counters) is not read
    again at all: a read could wait on Ceph, and costs a child
    (drivers/fs.read_head). One written to is read again (its start), and
    probed again only if that start changed."""

    MAX_AGE = 300.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self.hits = 0

    def unwritten(self, path: str, device: tuple[int, int, int],
                  counters: tuple[str, ...] | None, owner: str | None = None
                  ) -> Probed | None:
        """The probe of ``path`` if it is the same device, of the same size,
        mapped for the same image, and its counters say nothing was written
        to it since."""
        with self._lock:
            entry = self._entries.get(path)
            if entry is None or counters is None or entry.written != counters \
                    or entry.owner != owner \
                    or entry.key[:3] != device or time.monotonic() - entry.at > self.MAX_AGE:
                return None
            self.hits += 1
            return entry.probed

    def get(self, path: str, key: CacheKey, counters: tuple[str, ...] | None = None,
            owner: str | None = None) -> Probed | None:
        with self._lock:
            entry = self._entries.get(path)
            if entry is None or entry.key != key or time.monotonic() - entry.at > self.MAX_AGE:
                return None
            entry.written, entry.owner = counters, owner
            self.hits += 1
            return entry.probed

    def put(self, path: str, key: CacheKey, probed: Probed,
            counters: tuple[str, ...] | None = None, owner: str | None = None) -> None:
        with self._lock:
            self._entries[path] = _Entry(key, probed, time.monotonic(), counters, owner)

    def retain(self, paths: Iterable[str]) -> None:
        """Forget devices no longer seen (unmapped: the number may be reused)."""
        keep = set(paths)
        with self._lock:
            for path in [p for p in self._entries if p not in keep]:
                del self._entries[path]


def probe_mounted(fs: Filesystems, path: str, fs_type: str, mount_point: str) -> Probed | None:
    """A device mountinfo shows mounted as ``fs_type`` at its staging path: the
    mount proves the signature (a dead helper is the mapper's check). Only
    the superblock is read, for the size: from memory when cached (always
    for a mounted ext4), else by a child (drivers/fs.read_superblock).
    None: it does not say ``fs_type`` (an ext3 mounted by the ext4 driver):
    probe it in full."""
    sb = read_superblock(path, fs_type, fs.runner, mounted=True)
    if sb is None or sb.fs_type != fs_type:
        return None
    return Probed(fs_type, sb.uuid, fs_type, fs_size_from(sb, mount_point))


def probe_full(fs: Filesystems, cache: ProbeCache | None, path: str, major: int, minor: int,
               size: int, mount_point: str | None, owner: str | None = None) -> Probed:
    """Unless the same device was probed before, mapped for the same image
    (``owner``), and nothing was written to it since: read its start with
    O_DIRECT (unreadable is unknown, never blank), then blkid; both in
    children (drivers/fs.read_head). Without an owner it is always read."""
    # Mounted elsewhere, a live xfs size comes from statvfs: not cached.
    cacheable = cache is not None and mount_point is None
    counters = None
    if cacheable:
        with contextlib.suppress(OSError, ValueError):
            counters = written(major, minor)  # before the read: a write meanwhile shows next time
        if owner is not None and (hit := cache.unwritten(  # type: ignore[union-attr]
                path, (major, minor, size), counters, owner)) is not None:
            return hit
    head = read_head(fs.runner, path)
    key: CacheKey = (major, minor, size, hashlib.blake2b(head, digest_size=16).digest())
    if cacheable and (hit := cache.get(path, key, counters, owner)) is not None:  # type: ignore[union-attr]
        return hit
    probe = fs.probe_read(path)
    fs_size = None
    if probe.fs_type in ("ext4", "xfs"):
        sb = parse_superblock(head, probe.fs_type)
        fs_size = fs_size_from(sb, mount_point) if sb is not None else None
    luks_offset = luks.data_offset(head) if probe.fs_type == "crypto_LUKS" else None
    out = Probed(probe.fs_type, probe.uuid, probe.signature, fs_size, luks_offset)
    if cacheable:
        cache.put(path, key, out, counters, owner)  # type: ignore[union-attr]
    return out
