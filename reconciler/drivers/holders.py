"""Who still uses a mount or a block device: processes, from /proc.

For ``recover``: a fenced volume is unmounted and unmapped only once nothing
uses it (its users are the operator's to stop), so that it never ends half
torn down. Nothing here touches the filesystem in question: a fenced or
stalled one may not answer. Open files are matched by the mount id /proc
gives for each descriptor, mapped files by the device number in
/proc/PID/maps, working and root directories by their path.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class User:
    pid: int
    comm: str
    what: str  # "open file", "working directory", "mapped file", "open device"

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.comm}): {self.what}"


def _under(path: str, points: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in points)


def _fd_users(pid_dir: Path, mount_ids: set[int], devices: set[int]) -> str | None:
    for fd in _listdir(pid_dir / "fd"):
        with contextlib.suppress(OSError, ValueError):
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
    return None


def _maps_user(pid_dir: Path, fs_devices: set[int]) -> bool:
    with contextlib.suppress(OSError):
        for line in (pid_dir / "maps").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[3] != "00:00":
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                if os.makedev(major, minor) in fs_devices:
                    return True
    return False


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def users(mount_points: Iterable[str], mount_ids: Iterable[int], devices: Iterable[int],
          proc: Path = Path("/proc")) -> list[User]:
    """Processes (not this one) using the mounts (by mount point and id) or
    the block devices (by rdev; a filesystem on one of them maps files with
    that device number)."""
    points, ids, devs = list(mount_points), set(mount_ids), set(devices)
    out = []
    for name in _listdir(proc):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid_dir = proc / name
        try:
            comm = (pid_dir / "comm").read_text().strip()
        except OSError:
            continue
        what = _fd_users(pid_dir, ids, devs)
        if what is None:
            for link, label in (("cwd", "working directory"), ("root", "root directory")):
                with contextlib.suppress(OSError):
                    if _under(os.readlink(pid_dir / link), points):
                        what = label
                        break
        if what is None and _maps_user(pid_dir, devs):
            what = "mapped file"
        if what is not None:
            out.append(User(int(name), comm, what))
    return sorted(out, key=lambda u: u.pid)
