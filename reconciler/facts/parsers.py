"""Pure parsers: command output and /proc text in, plain data out.

Each is tested on recorded output (tests/data/). No I/O here.

Imported by apply/devicesteps.py; csi/node.py; daemon/events.py; drivers/ (8
modules); observe/devprobe.py, observe/leftovers.py, observe/node.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from reconciler.facts.observed import Mount

_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape_mount_path(s: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), s)


def parse_mountinfo(text: str | bytes) -> tuple[Mount, ...]:
    """Parse ``/proc/self/mountinfo`` (proc(5)). Malformed lines are skipped.
    Bytes that are not UTF-8 (a path anyone may choose) are kept as
    surrogates, as ``os.fsdecode`` keeps them: never equal to a path of ours."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    mounts = []
    # "\n" only: the kernel escapes newlines in paths, but not \v, \f, \x1c..
    # or U+2028, which splitlines() would also split a path (and its line) at.
    for line in text.split("\n"):
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


def _json(text: str) -> object:
    """A command's JSON output; ValueError (never anything else) when it is not."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _entries(doc: object) -> list[dict[str, object]]:
    return [d for d in doc if isinstance(d, dict)] if isinstance(doc, list) else []


def _str(d: dict[str, object], key: str) -> str | None:
    v = d.get(key)
    return v if isinstance(v, str) else None


def parse_losetup_json(text: str) -> tuple[LoopDevice, ...]:
    """``losetup --json --list`` (empty output when no loop device is set up).
    ValueError when it is not JSON; an entry that is not a loop device's is
    left out."""
    if not text.strip():
        return ()
    doc = _json(text)
    out = []
    for d in _entries(doc.get("loopdevices") if isinstance(doc, dict) else None):
        name, back = _str(d, "name"), _str(d, "back-file")
        if name is None:
            continue
        if back is not None:
            # losetup appends " (deleted)" when the backing file was unlinked.
            back = back.removesuffix(" (deleted)")
        size = d.get("sizelimit")
        out.append(LoopDevice(name=name, back_file=back, size=_positive(size)))
    return tuple(out)


def _positive(value: object) -> int | None:
    """A size as losetup writes it (a number or a numeric string); None for 0 or none."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


@dataclass(frozen=True)
class RbdDevice:
    pool: str
    namespace: str
    image: str
    snap: str | None
    device: str
    # rbd-nbd's listing: the pid of the rbd-nbd serving the device (the
    # kernel's own pid file keeps the first one's across a re-attach). krbd's
    # "id" is its device id, not a process: left out of comparisons.
    pid: int | None = field(default=None, compare=False)


def parse_rbd_nbd_version(text: str) -> str:
    """``rbd-nbd --version``: "ceph version 16.2.11 (3cf4…) pacific (stable)"
    -> "16.2.11". ValueError when it says no version."""
    words = text.split()
    if len(words) < 3 or words[:2] != ["ceph", "version"]:
        raise ValueError(f"not rbd-nbd's version: {text.strip()[:80]!r}")
    return words[2]


def parse_rbd_device_list(text: str) -> tuple[RbdDevice, ...]:
    """``rbd device list [-t nbd] --format json``.

    krbd writes the image as "name" and the head as snap "-"; ``rbd-nbd
    list-mapped`` (what ``-t nbd`` runs) writes "image" and snap "".
    ValueError when it is not JSON.
    """
    if not text.strip():
        return ()
    out = []
    for d in _entries(_json(text)):
        pool, image, device = _str(d, "pool"), _str(d, "name") or _str(d, "image"), \
            _str(d, "device")
        if pool is None or image is None or device is None:
            continue  # not a mapping as rbd writes one: none of ours
        snap = d.get("snap")
        pid = d.get("id")
        out.append(RbdDevice(pool=pool, namespace=_str(d, "namespace") or "", image=image,
                             snap=None if snap in (None, "", "-") else str(snap),
                             device=device,
                             pid=pid if isinstance(pid, int) and pid > 0 else None))
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
    try:
        return int(m.group(1)) * int(m.group(2)) if m else None
    except ValueError:  # more digits than int() takes
        return None


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
    # systemd-run's own words, before it ran rbd (drivers/scopes.py).
    if "transient scope unit" in low or "failed to connect to bus" in low:
        return MapError("systemd-run could not start the helper's scope (the node config's "
                        "helperScopes: never starts helpers without one)", detail)
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


@dataclass(frozen=True)
class Superblock:
    """What an ext4 or xfs superblock says (read from the device's first bytes)."""

    fs_type: str
    uuid: str
    size: int  # bytes the filesystem spans (dumpe2fs Block count × size; xfs dblocks)
    block_size: int
    # xfs: blocks of the internal log, which statvfs leaves out of f_blocks
    log_blocks: int = 0


EXT4_SB_OFFSET = 1024
_EXT4_MAGIC = 0xEF53
_EXT4_INCOMPAT_64BIT = 0x80


def _uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def parse_ext4_superblock(head: bytes) -> Superblock | None:
    """ext4 from the device's first 2 KiB (superblock at 1024, little-endian):
    s_blocks_count_lo (+4), s_log_block_size (+0x18), s_magic (+0x38),
    s_feature_compat/incompat/ro_compat (+0x5c/+0x60/+0x64), s_uuid (+0x68),
    s_blocks_count_hi (+0x150, only with the 64bit feature). None: no ext2/3/4 magic there."""
    sb = head[EXT4_SB_OFFSET:EXT4_SB_OFFSET + 1024]
    if len(sb) < 0x154 or int.from_bytes(sb[0x38:0x3A], "little") != _EXT4_MAGIC:
        return None
    log_bs = int.from_bytes(sb[0x18:0x1C], "little")
    if log_bs > 6:  # block sizes 1 KiB..64 KiB
        return None
    blocks = int.from_bytes(sb[0x4:0x8], "little")
    if int.from_bytes(sb[0x60:0x64], "little") & _EXT4_INCOMPAT_64BIT:
        blocks |= int.from_bytes(sb[0x150:0x154], "little") << 32
    bs = 1024 << log_bs
    return Superblock(_ext_kind(sb), _uuid(sb[0x68:0x78]), blocks * bs, bs)


def _ext_kind(sb: bytes) -> str:
    """ext2, ext3, ext4 or jbd, as blkid tells them apart: ext4 has a feature
    ext3 does not support; ext3 has a journal."""
    compat = int.from_bytes(sb[0x5C:0x60], "little")
    incompat = int.from_bytes(sb[0x60:0x64], "little")
    ro_compat = int.from_bytes(sb[0x64:0x68], "little")
    if incompat & 0x8:  # journal_dev: an external journal, no filesystem
        return "jbd"
    if ro_compat & ~0x7 or incompat & ~(0x2 | 0x4 | 0x10):
        return "ext4"
    return "ext3" if compat & 0x4 else "ext2"


def parse_xfs_superblock(head: bytes) -> Superblock | None:
    """xfs from sector 0 (big-endian): sb_magicnum "XFSB", sb_blocksize (+4),
    sb_dblocks (+8), sb_uuid (+32), sb_logstart (+48), sb_logblocks (+96).
    On a mounted filesystem grown online this may lag: use ``xfs_live_size``."""
    if len(head) < 100 or head[:4] != b"XFSB":
        return None
    bs = int.from_bytes(head[4:8], "big")
    if bs < 512 or bs > 65536 or bs & (bs - 1):
        return None
    dblocks = int.from_bytes(head[8:16], "big")
    internal_log = int.from_bytes(head[48:56], "big") != 0
    log_blocks = int.from_bytes(head[96:100], "big") if internal_log else 0
    return Superblock("xfs", _uuid(head[32:48]), dblocks * bs, bs, log_blocks)


def parse_superblock(head: bytes, fs_type: str) -> Superblock | None:
    """The ``fs_type`` (ext4 or xfs, as blkid or the mount named it) superblock."""
    if fs_type == "ext4":
        return parse_ext4_superblock(head)
    if fs_type == "xfs":
        return parse_xfs_superblock(head)
    return None


def xfs_live_size(f_blocks: int, f_frsize: int, log_blocks: int) -> int:
    """A mounted xfs's size from statvfs: the kernel reports f_blocks =
    sb_dblocks minus an internal log, from the live (in-memory) superblock."""
    return (f_blocks + log_blocks) * f_frsize


IO_MAX_KEYS = ("riops", "wiops", "rbps", "wbps")
# systemd's property for each io.max key (systemctl show / set-property).
SYSTEMD_IO = {"riops": "IOReadIOPSMax", "wiops": "IOWriteIOPSMax",
              "rbps": "IOReadBandwidthMax", "wbps": "IOWriteBandwidthMax"}


def parse_io_max(text: str) -> dict[str, dict[str, int]]:
    """cgroup v2 io.max ("MAJ:MIN rbps=max wbps=1048576 riops=max wiops=100"
    per line) -> {"MAJ:MIN": {key: limit}}; "max" (no limit) is left out."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        dev, _, rest = line.strip().partition(" ")
        if not dev:
            continue
        limits = {}
        for item in rest.split():
            key, _, value = item.partition("=")
            if key in IO_MAX_KEYS and (n := _count(value)) is not None:
                limits[key] = n
        out[dev] = limits
    return out


def parse_systemd_io(text: str) -> dict[str, dict[str, int]]:
    """``systemctl show -p IOReadIOPSMax ...`` ("IOReadIOPSMax=/dev/rbd0 1000",
    one line per device) -> {device path: {io.max key: limit}}."""
    by_prop = {prop: key for key, prop in SYSTEMD_IO.items()}
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        prop, _, value = line.partition("=")
        key = by_prop.get(prop.strip())
        parts = value.split()
        n = _count(parts[1]) if len(parts) == 2 else None
        if key is None or n is None:
            continue  # no entry ("IOReadIOPSMax="), or "infinity"
        out.setdefault(parts[0], {})[key] = n
    return out


def _count(value: str) -> int | None:
    """A decimal count in ASCII digits ("max", "infinity", anything else: None)."""
    if not (value.isascii() and value.isdigit()):
        return None
    try:
        return int(value)
    except ValueError:  # more digits than int() takes
        return None
