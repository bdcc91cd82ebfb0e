"""Which mounts, devices, helpers (and the processes that keep a dead
helper's volume from its repair) and images belong to which volume: what the
event sources (daemon/events.py) map an event back to a volume with.

Built per volume from the pass that last observed it, so a pass that looked
at three volumes updates three entries and leaves the others as they were.

Imported by daemon/passes.py, daemon/watchers.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from reconciler.daemon.events import Interest
from reconciler.facts.observed import Observed
from reconciler.spec.model import Volume


@dataclass(frozen=True)
class VolumeInterest:
    paths: frozenset[str] = frozenset()
    devices: frozenset[str] = frozenset()  # kernel names: "loop3", "rbd0", "dm-2"
    pids: frozenset[int] = frozenset()
    images: frozenset[tuple[str, str, int]] = frozenset()  # fuse-mapped: pool, image, size


def volume_interest(v: Volume, observed: Observed,
                    helpers: Mapping[str, int]) -> VolumeInterest:
    """``helpers``: rbd-fuse mount point -> helper pid, as the mapper knows them."""
    if v.kind != "Volume":
        return VolumeInterest()  # its volumes' entries cover the images
    paths = {t.path for t in v.publish}
    if v.stage is not None:
        paths.add(v.stage.path)
    devices, pids, images = set(), set(), set()
    key = (v.image.pool, v.image.name)
    rdevs = set()
    for m in observed.mappings:
        if (m.pool, m.image) != key:
            continue
        if m.device:
            devices.add(os.path.basename(m.device))
            dev = observed.devices.get(m.device)
            if dev is not None:
                rdevs.add((dev.major, dev.minor))
            # An open LUKS2 device over it holds the filesystem: the kernel
            # names it "dm-MINOR" in its messages.
            if (crypt := observed.crypts.get(m.device)) is not None:
                devices.add(f"dm-{crypt.minor}")
                rdevs.add((crypt.major, crypt.minor))
        if m.kind == "fuse" and m.fuse_mount:
            paths.add(m.fuse_mount)
            if (pid := helpers.get(m.fuse_mount)) is not None:
                pids.add(pid)
            img = observed.images.get(key)
            if img is not None:
                images.add((m.pool, m.image, img.size))
            # A dead one left as it is while in use: its users' exits are
            # what lets it be brought back (a file closed is seen at the resync).
            users = observed.mount_users.get(m.device) if m.device else None
            pids |= {u.pid for u in users or () if u.pid is not None}
    # Wherever the device is mounted now, a path the spec no longer names included.
    paths |= {m.mount_point for m in observed.mounts if (m.major, m.minor) in rdevs}
    return VolumeInterest(frozenset(paths), frozenset(devices), frozenset(pids),
                          frozenset(images))


def combine(entries: Mapping[str, VolumeInterest]) -> Interest:
    paths: dict[str, str] = {}
    devices: dict[str, str] = {}
    pids: dict[int, str] = {}
    images: dict[tuple[str, str], tuple[str, int]] = {}
    for name, e in sorted(entries.items()):
        paths.update(dict.fromkeys(e.paths, name))
        devices.update(dict.fromkeys(e.devices, name))
        pids.update(dict.fromkeys(e.pids, name))
        images.update({(pool, image): (name, size) for pool, image, size in e.images})
    return Interest(paths, devices, pids, images)


def forget(entries: dict[str, VolumeInterest], keep: Iterable[str]) -> None:
    """Drop the entries of volumes no longer declared or released."""
    keep = set(keep)
    for name in [n for n in entries if n not in keep]:
        del entries[name]
