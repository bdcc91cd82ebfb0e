"""Who uses a dead fuse-loop volume (its rbd-fuse helper is gone): the
observation behind its repair. The planner unmounts, remaps and remounts
such a volume by itself only when nobody does (safety rule 7), so this
names every user: a process with a file open on its mounts (the staging
mount, the publish binds, the dead FUSE mount), its working or root
directory there, a file of it mapped, its loop or LUKS2 device open; a
process whose /proc cannot be read; a mount stacked inside one of them.

Nothing here does I/O to the dead filesystem (a stat of a FUSE path could
wait on a helper): /proc, mountinfo, and, for processes /proc does not
show, the kernel's count of each mount (drivers/mountbusy.py). ``dead_fuse_users`` is pure over
its inputs (the mount table, device numbers, a /proc root), so a fake
/proc tests it. Imported by observe/node.py only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from reconciler.drivers import mountbusy, procfs
from reconciler.drivers.holders import users
from reconciler.facts.observed import Mapping, Mount, MountUser


def dead_fuse_users(mapping: Mapping, mounts: Iterable[Mount],
                    rdevs: Iterable[tuple[int, int]], proc: Path = Path("/proc"),
                    ignore_pids: Iterable[int] = (),
                    busy: Callable[[str], bool | None] = mountbusy.busy
                    ) -> tuple[MountUser, ...]:
    """The users of a dead fuse mapping. ``rdevs``: the device numbers its
    filesystem may sit on (the loop device, an open LUKS2 device over it).
    A process whose /proc entries cannot be read is a user unless the kernel
    (``busy``, per mount of the filesystem) says nothing holds any of them:
    its count covers every process; when it does not answer, unsure: a user."""
    mounts = list(mounts)
    devs = set(rdevs)
    ours = [m for m in mounts if (m.major, m.minor) in devs
            or (mapping.fuse_mount is not None and m.mount_point == mapping.fuse_mount)]
    ids = {m.mount_id for m in ours}
    points = [m.mount_point for m in ours]
    found = [MountUser(None, f"a mount at {m.mount_point} ({m.fs_type} {m.source}) inside "
                       f"{next(o.mount_point for o in ours if o.mount_id == m.parent_id)}")
             for m in mounts if m.parent_id in ids and m.mount_id not in ids]
    # Another mount at one of the same points (under ours): what an unmount
    # of ours would uncover, and a remount would stack on.
    found += [MountUser(None, f"another mount at {m.mount_point} ({m.fs_type} {m.source})")
              for m in mounts if m.mount_id not in ids and m.mount_point in points
              and m.mount_point != mapping.fuse_mount]
    # The FUSE mount's own device: a file of the image mapped from it.
    numbers = {os.makedev(*d) for d in devs} | {os.makedev(m.major, m.minor) for m in ours}
    # Only while the pid is still an rbd-fuse (a zombie keeps its name): a
    # recorded helper pid may have been reaped and reused by a user.
    skip = {pid for pid in ignore_pids if _comm(proc / str(pid)) == "rbd-fuse"}
    procs = [u for u in users(points, ids, numbers, proc) if u.pid not in skip]
    found += [MountUser(u.pid, str(u)) for u in procs if not u.unreadable]
    unsure = [u for u in procs if u.unreadable]
    if found or not unsure:
        return tuple(found + [MountUser(u.pid, str(u)) for u in unsure])
    # Only processes we cannot read: the kernel's count of each mount decides
    # (not the dead FUSE mount: its loop device holds it, always).
    said = [busy(m.mount_point) for m in ours if m.mount_point != mapping.fuse_mount]
    if said and all(b is False for b in said):
        return ()
    why = ("and the kernel counts a user" if any(said) else "and the kernel did not say")
    return tuple(MountUser(u.pid, f"{u} ({why})") for u in unsure)


def _comm(pid_dir: Path) -> str | None:
    try:
        return procfs.read_text(pid_dir / "comm").strip()
    except OSError:
        return None


def dead_fuse_mappings(mappings: Iterable[Mapping], wanted: set[tuple[str, str]]
                       ) -> list[Mapping]:
    """The dead fuse-loop mappings of wanted images (only those are repaired)."""
    return [m for m in mappings if m.kind == "fuse" and m.problem and m.device
            and (m.pool, m.image) in wanted]


def loop_number(device: str) -> tuple[int, int] | None:
    """The loop device's (major, minor), from its node on devtmpfs (never
    the device itself); None if it cannot be read."""
    try:
        rdev = os.stat(device).st_rdev
    except OSError:
        return None
    return os.major(rdev), os.minor(rdev)
