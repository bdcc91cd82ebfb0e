"""Pure parsers: command output and /proc text in, plain data out.

Each is tested on recorded output (tests/data/). No I/O here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .observed import Mount

_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape_mount_path(s: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), s)


def parse_mountinfo(text: str) -> tuple[Mount, ...]:
    """Parse ``/proc/self/mountinfo`` (proc(5)). Malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            major, minor = fields[2].split(":")
            mounts.append(Mount(
                mount_id=int(fields[0]),
                parent_id=int(fields[1]),
                major=int(major),
                minor=int(minor),
                root=unescape_mount_path(fields[3]),
                mount_point=unescape_mount_path(fields[4]),
                options=frozenset(fields[5].split(",")),
                fs_type=fields[sep + 1],
                source=unescape_mount_path(fields[sep + 2]),
                super_options=frozenset(fields[sep + 3].split(",")) if len(fields) > sep + 3
                else frozenset(),
            ))
        except (ValueError, IndexError):
            continue
    return tuple(mounts)


@dataclass(frozen=True)
class LoopDevice:
    name: str
    back_file: str | None
    size: int | None = None


def parse_losetup_json(text: str) -> tuple[LoopDevice, ...]:
    """``losetup --json --list`` (empty output when no loop device is set up)."""
    if not text.strip():
        return ()
    out = []
    for d in json.loads(text).get("loopdevices", []):
        back = d.get("back-file")
        if back is not None:
            # losetup appends " (deleted)" when the backing file was unlinked.
            back = back.removesuffix(" (deleted)")
        size = d.get("sizelimit")
        out.append(LoopDevice(name=d["name"], back_file=back,
                              size=int(size) if size not in (None, "0", 0) else None))
    return tuple(out)


@dataclass(frozen=True)
class RbdDevice:
    pool: str
    namespace: str
    image: str
    snap: str | None
    device: str


def parse_rbd_device_list(text: str) -> tuple[RbdDevice, ...]:
    """``rbd device list [-t nbd] --format json``.

    krbd writes the image as "name" and the head as snap "-"; ``rbd-nbd
    list-mapped`` (what ``-t nbd`` runs) writes "image" and snap "".
    """
    if not text.strip():
        return ()
    out = []
    for d in json.loads(text):
        snap = d.get("snap")
        out.append(RbdDevice(pool=d["pool"], namespace=d.get("namespace") or "",
                             image=d["name"] if "name" in d else d["image"],
                             snap=None if snap in (None, "", "-") else snap,
                             device=d["device"]))
    return tuple(out)


@dataclass(frozen=True)
class Probe:
    fs_type: str | None
    uuid: str | None
    signature: str | None  # TYPE or PTTYPE: anything mkfs would destroy


def parse_blkid_export(text: str, returncode: int) -> Probe:
    """``blkid -p -o export DEV``: exit 2 means nothing found (a blank device).

    Any other non-zero exit is an error: never read a failed probe as blank.
    """
    if returncode == 2:
        return Probe(None, None, None)
    if returncode != 0:
        raise ValueError(f"blkid failed with exit status {returncode}")
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    fs = values.get("TYPE")
    return Probe(fs_type=fs, uuid=values.get("UUID"), signature=fs or values.get("PTTYPE"))


def parse_dumpe2fs_size(text: str) -> int | None:
    """Filesystem size in bytes from ``dumpe2fs -h``."""
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        values[key.strip()] = value.strip()
    try:
        return int(values["Block count"]) * int(values["Block size"])
    except (KeyError, ValueError):
        return None


def parse_xfs_db_size(text: str) -> int | None:
    """Filesystem size in bytes from ``xfs_db -r -c 'sb 0' -c 'p dblocks blocksize'``."""
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    try:
        return int(values["dblocks"]) * int(values["blocksize"])
    except (KeyError, ValueError):
        return None


_XFS_DATA = re.compile(r"^data\s+=.*?\bbsize=(\d+)\s+blocks=(\d+)", re.MULTILINE)


def parse_xfs_info_size(text: str) -> int | None:
    """Filesystem size in bytes from ``xfs_info`` (the ``data`` section).

    On a mount point xfs_info asks the live filesystem; the on-disk
    superblock that xfs_db reads can lag behind an online grow.
    """
    m = _XFS_DATA.search(text)
    return int(m.group(1)) * int(m.group(2)) if m else None


class MapError(Exception):
    """A mapper refused; ``reason`` says why in words an operator can act on."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def explain_map_failure(kind: str, returncode: int, stderr: str) -> MapError:
    """Turn ``rbd device map`` failures into a reason.

    Recorded on a kernel without the modules: krbd exits 2 with
    "rbd: map failed: (2) No such file or directory"; nbd exits 22.
    """
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    detail = lines[-1].strip() if lines else f"exit status {returncode}"
    low = stderr.lower()
    # ENOENT after "sysfs write failed" comes from a loaded module (no such image
    # or pool); without the module, rbd fails before writing or says modprobe failed.
    if kind == "krbd" and ("modprobe" in low or "kernel module" in low or (
            "(2) no such file" in low and "sysfs write failed" not in low)):
        return MapError("the kernel has no rbd module (krbd unavailable)", detail)
    if kind == "nbd" and (returncode == 22 or ("nbd" in low and "module" in low)):
        return MapError("rbd-nbd could not attach (no nbd kernel module?)", detail)
    if "(13) permission denied" in low or "(1) operation not permitted" in low:
        return MapError("permission denied by Ceph (check the cephx user's caps)", detail)
    if "(6) no such device or address" in low:
        return MapError("the kernel refused the image (unsupported features?)", detail)
    if "(110) connection timed out" in low:
        return MapError("Ceph did not answer in time", detail)
    return MapError(f"{kind} map failed (exit {returncode})", detail)
