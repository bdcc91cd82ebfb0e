"""Who still uses a mount or a block device: processes, from /proc.

For ``recover``: a fenced volume is unmounted and unmapped only once nothing
uses it (its users are the operator's to stop), so that it never ends half
torn down. Nothing here touches the filesystem in question: a fenced or
stalled one may not answer. Open files are matched by the mount id /proc
gives for each descriptor, mapped files by the device number in
/proc/PID/maps, working and root directories by their path. A process in
another mount namespace is matched against that namespace's own mounts of
the devices (its /proc/PID/mountinfo: mount ids and points differ there).
A live process whose entries cannot be read is reported as "unreadable"
(``User.unreadable``): what it uses is unknown, and its caller decides (the
dead-fuse repair asks the kernel, else takes it as a user; ``recover``
leaves it out, as it always did, its umounts not being lazy).

Imported by engine/operator.py (``recover``) and observe/node.py (a dead
rbd-fuse's volume: repaired only when nobody uses it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from reconciler.facts.parsers import parse_mountinfo

GONE = (errno.ENOENT, errno.ESRCH)  # the process (or that descriptor) went away
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class User:
    pid: int
    comm: str
    what: str  # "open file", "working directory", "mapped file", "open device"

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.comm}): {self.what}"

    @property
    def unreadable(self) -> bool:
        """What it uses is unknown: its /proc entries could not be read."""
        return self.what.startswith(UNREADABLE)


def _under(path: str, points: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in points)


class _Unreadable(Exception):
    """A live process's entry could not be read: it counts as a user."""


def _gone(exc: OSError) -> bool:
    return exc.errno in GONE


def _fd_users(pid_dir: Path, mount_ids: set[int], devices: set[int]) -> str | None:
    try:
        fds = os.listdir(pid_dir / "fd")
    except OSError as exc:
        if _gone(exc):
            return None
        raise _Unreadable(f"fd: {exc.strerror}") from None
    for fd in fds:
        try:
            info = (pid_dir / "fdinfo" / fd).read_text()
            mnt = next((int(line.split()[1]) for line in info.splitlines()
                        if line.startswith("mnt_id:")), None)
            if mnt in mount_ids:
                return "open file"
            target = os.readlink(pid_dir / "fd" / fd)
            if target.startswith("/dev/"):
                # stat of the descriptor: the device node (devtmpfs), never the device
                st = os.stat(pid_dir / "fd" / fd)
                if stat.S_ISBLK(st.st_mode) and st.st_rdev in devices:
                    return "open device"
        except ValueError:
            continue
        except OSError as exc:
            if _gone(exc):
                continue  # closed since the listing
            raise _Unreadable(f"fd {fd}: {exc.strerror}") from None
    return None


def _maps_user(pid_dir: Path, fs_devices: set[int]) -> bool:
    try:
        text = (pid_dir / "maps").read_text()
    except OSError as exc:
        if _gone(exc):
            return False
        raise _Unreadable(f"maps: {exc.strerror}") from None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[3] != "00:00":
            with contextlib.suppress(ValueError):
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                if os.makedev(major, minor) in fs_devices:
                    return True
    return False


def _dir_user(pid_dir: Path, points: list[str]) -> str | None:
    for link, label in (("cwd", "working directory"), ("root", "root directory")):
        try:
            if _under(os.readlink(pid_dir / link), points):
                return label
        except OSError as exc:
            if not _gone(exc):
                raise _Unreadable(f"{link}: {exc.strerror}") from None
    return None


class _Namespaces:
    """The mounts of the devices as each mount namespace sees them: ours are
    given; another's are read once from a process of it."""

    def __init__(self, proc: Path, points: list[str], ids: set[int], devs: set[int]) -> None:
        self.devs = devs
        self.ours = _ns(proc / "self")
        self.seen: dict[str | None, tuple[list[str], set[int]]] = {self.ours: (points, ids)}

    def of(self, pid_dir: Path) -> tuple[list[str], set[int]]:
        ns = _ns(pid_dir)
        if ns in self.seen:
            return self.seen[ns]
        try:
            text = (pid_dir / "mountinfo").read_bytes().decode("utf-8", "surrogateescape")
        except OSError as exc:
            if _gone(exc):
                return [], set()
            raise _Unreadable(f"mountinfo: {exc.strerror}") from None
        mine = [m for m in parse_mountinfo(text)
                if os.makedev(m.major, m.minor) in self.devs]
        found = ([m.mount_point for m in mine], {m.mount_id for m in mine})
        self.seen[ns] = found
        return found


def _ns(pid_dir: Path) -> str | None:
    try:
        return os.readlink(pid_dir / "ns" / "mnt")
    except OSError:
        return None  # gone, or no namespaces here (a fake /proc): taken as ours


def users(mount_points: Iterable[str], mount_ids: Iterable[int], devices: Iterable[int],
          proc: Path = Path("/proc")) -> list[User]:
    """Processes (not this one) using the mounts (by mount point and id) or
    the block devices (by rdev; a filesystem on one of them maps files with
    that device number). One whose /proc entries cannot be read (and that
    has not exited) is reported too, as ``unreadable``: what it does is unknown."""
    points, ids, devs = list(mount_points), set(mount_ids), set(devices)
    spaces = _Namespaces(proc, points, ids, devs)
    out = []
    # A process table that cannot be listed is unknown, never "nobody":
    # OSError (safety rule 7).
    for name in os.listdir(proc):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid_dir = proc / name
        try:
            comm = (pid_dir / "comm").read_text().strip()
        except OSError as exc:
            if _gone(exc):
                continue
            comm = "?"
        try:
            ns_points, ns_ids = spaces.of(pid_dir)
            what = (_fd_users(pid_dir, ns_ids, devs) or _dir_user(pid_dir, ns_points)
                    or ("mapped file" if _maps_user(pid_dir, devs) else None))
        except _Unreadable as exc:
            what = f"{UNREADABLE} ({exc}): taken as a user"
        if what is not None:
            out.append(User(int(name), comm, what))
    return sorted(out, key=lambda u: u.pid)
