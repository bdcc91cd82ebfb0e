"""One look at the node for a sweep of leftovers (``facts.leftovers``).

The mappings (as the mappers list them), our nbd records of this boot, every
loop device and open LUKS2 device (from sysfs), the rbd-fuse and rbd-nbd
processes (from /proc), and the mounts; then, for those a sweep would
remove, who uses each (drivers/holders.py). Nothing here stats a FUSE path
or opens a device: a helper that does not answer must not hang the look.

Imported by engine/orphans.py only; the verdicts are plan/orphans.py's.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from reconciler.drivers import procfs
from reconciler.drivers.holders import users
from reconciler.drivers.kernelmapper import nbd_cookie
from reconciler.drivers.mountbusy import busy
from reconciler.drivers.run import CommandError
from reconciler.facts.leftovers import CryptDev, Helper, Leftovers, LoopDev, Rdev
from reconciler.facts.luks import CRYPT_UUID_PREFIX
from reconciler.facts.observed import Mapping, Mount
from reconciler.facts.parsers import parse_mountinfo
from reconciler.observe.node import Node
from reconciler.state.registry import NbdMappings

HELPERS = ("rbd-fuse", "rbd-nbd")


def look(node: Node, sys_root: Path = Path("/sys"), proc: Path = Path("/proc")) -> Leftovers:
    """What the node has now; a listing that fails is named in ``errors``."""
    mountinfo = procfs.mountinfo()
    errors: list[str] = []
    mappings: list[Mapping] = []
    try:
        mappings += node.fuse.list(mountinfo=mountinfo)
    except OSError as exc:
        errors.append(f"rbd-fuse mounts not listed: {exc}")
    for kind in ("krbd", "nbd"):
        if kind in node.mappers_available:
            try:
                mappings += node.mapper(kind).list()
            except (CommandError, OSError) as exc:
                errors.append(f"{kind} mappings not listed: {exc}")
    try:
        nbd = NbdMappings(node.config.state_dir)
        records, cookies = nbd.images(), nbd.cookies()
    except OSError as exc:
        records, cookies = {}, {}
        errors.append(f"nbd records not read: {exc}")
    backends = {m.device: c for m in mappings if m.kind == "nbd" and m.device
                and (c := nbd_cookie(m.device, sys_root)) is not None}
    loops, crypts = loop_devices(sys_root), crypt_devices(sys_root)
    rdevs = {lo.path: lo.rdev for lo in loops} | {c.path: c.rdev for c in crypts}
    for m in mappings:
        if m.device and m.device not in rdevs and (rdev := _sysfs_rdev(m.device, sys_root)):
            rdevs[m.device] = rdev
    for c in crypts:
        if c.raw not in rdevs and (rdev := _sysfs_rdev(c.raw, sys_root)):
            rdevs[c.raw] = rdev
    return Leftovers(mappings=tuple(mappings), nbd_records=records, loops=loops,
                     crypts=crypts, helpers=helpers(sys_root, proc),
                     mounts=(mounts := parse_mountinfo(mountinfo)), rdevs=rdevs,
                     errors=tuple(errors), nbd_cookies=cookies, nbd_backends=backends,
                     fuse_conns=fuse_connections(mounts, sys_root))


def fuse_connections(mounts: tuple[Mount, ...], sys_root: Path = Path("/sys")
                     ) -> frozenset[int] | None:
    """Every live FUSE connection (fusectl's directory: one per FUSE
    superblock, in any mount namespace, detached ones too); None when
    fusectl is not mounted there (an empty directory says nothing)."""
    where = str(sys_root / "fs" / "fuse" / "connections")
    if not any(m.fs_type == "fusectl" and m.mount_point == where for m in mounts):
        return None
    try:
        return frozenset(int(n) for n in os.listdir(where) if n.isdigit())
    except OSError:
        return None


def _sysfs_rdev(device: str, sys_root: Path) -> Rdev | None:
    """A block device's number from sysfs (no open, no stat of the node)."""
    try:
        major, minor = (int(x) for x in procfs.read_text(
            sys_root / "class" / "block" / os.path.basename(device) / "dev").split(":"))
    except (OSError, ValueError):
        return None
    return major, minor


def loop_devices(sys_root: Path = Path("/sys")) -> tuple[LoopDev, ...]:
    """Each loop device with a backing file (not ``losetup``: it stats each
    file, and one on a FUSE mount whose helper hangs hangs it for good)."""
    out = []
    for backing in sorted((sys_root / "block").glob("loop*/loop/backing_file")):
        path = f"/dev/{backing.parent.parent.name}"
        with contextlib.suppress(OSError):
            back = procfs.read_text(backing).rstrip("\n").removesuffix(" (deleted)")
            if (rdev := _sysfs_rdev(path, sys_root)) is not None:
                out.append(LoopDev(path, rdev, back))
    return tuple(out)


def crypt_devices(sys_root: Path = Path("/sys")) -> tuple[CryptDev, ...]:
    """Every open LUKS2 device (its dm uuid says cryptsetup made it) and the
    device under it."""
    out = []
    for uuid_file in sorted((sys_root / "block").glob("dm-*/dm/uuid")):
        base = uuid_file.parent.parent
        with contextlib.suppress(OSError, ValueError):
            if not procfs.read_text(uuid_file).startswith(CRYPT_UUID_PREFIX):
                continue
            name = procfs.read_text(base / "dm" / "name").strip()
            slaves = sorted(os.listdir(base / "slaves"))
            rdev = _sysfs_rdev(base.name, sys_root)
            if len(slaves) == 1 and rdev is not None:
                out.append(CryptDev(name, f"/dev/mapper/{name}", rdev, f"/dev/{slaves[0]}"))
    return tuple(out)


def helpers(sys_root: Path = Path("/sys"), proc: Path = Path("/proc")) -> tuple[Helper, ...]:
    """Live rbd-fuse and rbd-nbd processes: an rbd-fuse by its mount point
    argument, an rbd-nbd by the nbd device whose pid it is."""
    nbd_of: dict[int, str] = {}
    for pid_file in (sys_root / "block").glob("nbd*/pid"):
        with contextlib.suppress(OSError, ValueError):
            nbd_of[int(procfs.read_text(pid_file))] = f"/dev/{pid_file.parent.name}"
    out = []
    for pid_dir in proc.glob("[0-9]*"):
        try:
            # comm first (no read of the process's memory): a cmdline read
            # takes its mm lock, which a process stuck in a page fault on a
            # stalled device can hold up for as long; only a helper's is read.
            if procfs.read_text(pid_dir / "comm").rstrip("\n") not in HELPERS:
                continue
            args = (pid_dir / "cmdline").read_bytes().split(b"\0")
            kind = os.path.basename(os.fsdecode(args[0]))
            if kind not in HELPERS or procfs.stat_fields(pid_dir / "stat")[1][0] in "ZX":
                continue
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not one
        pid = int(pid_dir.name)
        paths = [os.fsdecode(a) for a in args[1:] if a.startswith(b"/")]
        serves = (paths[-1] if paths else None) if kind == "rbd-fuse" else nbd_of.get(pid)
        out.append(Helper(pid, kind, serves))
    return tuple(sorted(out, key=lambda h: h.pid))


def mount_users(point: str, seen: Leftovers, proc: Path = Path("/proc"),
                ask_kernel: bool = True) -> tuple[str, ...]:
    """The processes in the mount(s) at ``point``: open files, working or
    root directories; the rbd-fuse serving a FUSE mount is no user of it.
    A process whose /proc cannot be read is a user unless the kernel's count
    of the mount says nothing holds it (as for a dead rbd-fuse's volume,
    observe/deadfuse.py); ``ask_kernel`` False: not asked (a FUSE mount,
    whose lookup could wait on its helper), no user for now: its umount is
    never lazy, so the kernel refuses it while anything holds it. OSError:
    the process table could not be read (unknown, never nobody)."""
    here = [m for m in seen.mounts if m.mount_point == point]
    # Its device numbers too: a process in another mount namespace (a copy
    # of the mount propagated there) is matched against that namespace's
    # own mounts of them, and a file of it mapped is seen in /proc/PID/maps.
    # Not devtmpfs's (a block-mode bind of a device node): every /dev is one,
    # and the node's device has its own orphan, whose users are asked.
    devs = {os.makedev(m.major, m.minor) for m in here if m.fs_type != "devtmpfs"}
    # Not its helpers: the rbd-fuse serving it, and the rbd-nbd serving its
    # device (which holds that device open: not a user of the filesystem).
    helpers = {h.pid for h in seen.helpers
               if h.serves == point or (h.kind == "rbd-nbd" and _rdev(h.serves) in devs)}
    found = [u for u in users([point], [m.mount_id for m in here], devs, proc)
             if u.pid not in helpers]
    sure = tuple(str(u) for u in found if not u.unreadable)
    unsure = [u for u in found if u.unreadable]
    if sure or not unsure or not ask_kernel:
        return sure
    said = busy(point)
    if said is False:
        return ()
    why = "and the kernel counts a user" if said else "and the kernel did not say"
    return tuple(f"{u} ({why})" for u in unsure)


def device_users(device: str, seen: Leftovers, sys_root: Path = Path("/sys"),
                 proc: Path = Path("/proc"), above: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The kernel's holders of ``device`` (a dm device over it) and the
    processes that hold it open or map a file of it; its own rbd-nbd is no
    user. A holder in ``above`` (a leftover stacked on it, by device path:
    the sweep removes it first, or keeps ``device`` because it stays) is no
    user either. OSError: not known (no device number, a table not read)."""
    rdev = seen.rdevs.get(device)
    if rdev is None:
        raise OSError(f"{device}: no device number seen")
    stacked = {seen.rdevs[a] for a in above if a in seen.rdevs}
    held = tuple(f"held by {h}" for h in os.listdir(
        sys_root / "dev" / "block" / f"{rdev[0]}:{rdev[1]}" / "holders")
        if not stacked or _sysfs_rdev(h, sys_root) not in stacked)
    helpers = {h.pid for h in seen.helpers if h.serves == device}
    # A process whose /proc cannot be read is left out here, as recover
    # leaves it out: a device's users are its mounts (each a leftover of its
    # own, gone first, or it stays) and its openers, which /proc shows us.
    return held + tuple(str(u) for u in users((), (), [os.makedev(*rdev)], proc)
                        if u.pid not in helpers and not u.unreadable)


def _rdev(device: str | None) -> int | None:
    """The device number of a device node (a stat of /dev: never the device)."""
    if not device:
        return None
    try:
        return os.stat(device).st_rdev
    except OSError:
        return None
