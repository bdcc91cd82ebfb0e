"""Device probes for observe: no fork where a mount already proves the
content, and a probe kept across daemon passes while the device is unchanged.

For observing only: apply re-probes (blkid) right before any mkfs.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

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
# partition table rewrite the start of the device, a remap or resize changes
# the rest. A signature written only at the end is caught by the age limit
# (and by apply's own blkid before mkfs).
CacheKey = tuple[int, int, int, bytes]


class ProbeCache:
    """Probes of unmounted devices, per path, for the daemon's Node."""

    MAX_AGE = 300.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[CacheKey, Probed, float]] = {}
        self.hits = 0

    def get(self, path: str, key: CacheKey) -> Probed | None:
        with self._lock:
            entry = self._entries.get(path)
            if entry is None or entry[0] != key or time.monotonic() - entry[2] > self.MAX_AGE:
                return None
            self.hits += 1
            return entry[1]

    def put(self, path: str, key: CacheKey, probed: Probed) -> None:
        with self._lock:
            self._entries[path] = (key, probed, time.monotonic())

    def retain(self, paths: Iterable[str]) -> None:
        """Forget devices no longer seen (unmapped: the number may be reused)."""
        keep = set(paths)
        with self._lock:
            for path in [p for p in self._entries if p not in keep]:
                del self._entries[path]


def probe_mounted(path: str, fs_type: str, mount_point: str) -> Probed | None:
    """A device mountinfo shows mounted as ``fs_type`` at its staging path: the
    mount proves the signature (a dead helper is the mapper's check). Only
    the superblock is read, for the size. None: it does not say ``fs_type``
    (an ext3 mounted by the ext4 driver): probe it in full."""
    sb = read_superblock(path, fs_type)
    if sb is None or sb.fs_type != fs_type:
        return None
    return Probed(fs_type, sb.uuid, fs_type, fs_size_from(sb, mount_point))


def probe_full(fs: Filesystems, cache: ProbeCache | None, path: str, major: int, minor: int,
               size: int, mount_point: str | None) -> Probed:
    """Read the start with O_DIRECT (unreadable is unknown, never blank), then
    blkid unless the same device with the same start was probed before."""
    head = read_head(path)
    key: CacheKey = (major, minor, size, hashlib.blake2b(head, digest_size=16).digest())
    # Mounted elsewhere, a live xfs size comes from statvfs: not cached.
    cacheable = cache is not None and mount_point is None
    if cacheable and (hit := cache.get(path, key)) is not None:  # type: ignore[union-attr]
        return hit
    probe = fs.probe_read(path)
    fs_size = None
    if probe.fs_type in ("ext4", "xfs"):
        sb = parse_superblock(head, probe.fs_type)
        fs_size = fs_size_from(sb, mount_point) if sb is not None else None
    luks_offset = luks.data_offset(head) if probe.fs_type == "crypto_LUKS" else None
    out = Probed(probe.fs_type, probe.uuid, probe.signature, fs_size, luks_offset)
    if cacheable:
        cache.put(path, key, out)  # type: ignore[union-attr]
    return out
