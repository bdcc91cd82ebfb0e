"""Names and ids for CSI volumes.

A CSI request name is up to 128 characters of any case, so it can be neither
a volume's metadata.name (a DNS label) nor, safely, an RBD image name: both
are derived from it with a stable hash. The volume id names the pool and the
image, so a node that never saw the CreateVolume can stage it from the id.

Imported by csi/ (6 modules).
"""

from __future__ import annotations

import hashlib
import re

from reconciler.csi.errors import quoted

ID_PREFIX = "rbdr1"
SNAP_ID_PREFIX = "rbdr1s"
_SNAP = re.compile(r"csi-snap-[0-9a-f]{32}")
_IMAGE = re.compile(r"csi-[0-9a-f]{32}")
_RBD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_ID_BYTES = 128


def image_for_request(request_name: str) -> str:
    return "csi-" + hashlib.sha256(request_name.encode()).hexdigest()[:32]


def volume_id(pool: str, image: str) -> str:
    vid = f"{ID_PREFIX}:{pool}:{image}"
    if len(vid.encode()) > MAX_ID_BYTES:
        raise ValueError(f"pool name {quoted(pool)} is too long for a CSI volume id")
    return vid


def parse_volume_id(vid: str) -> tuple[str, str] | None:
    """(pool, image), or None for an id we never hand out."""
    parts = vid.split(":")
    if len(parts) != 3 or parts[0] != ID_PREFIX:
        return None
    pool, image = parts[1], parts[2]
    if not (_RBD_NAME.fullmatch(pool) and _RBD_NAME.fullmatch(image)):
        return None
    return pool, image


def volume_name(pool: str, image: str) -> str:
    """The volume's metadata.name on every node: a function of the id alone."""
    if _IMAGE.fullmatch(image):
        return image
    return "csi-x" + hashlib.sha256(f"{pool}/{image}".encode()).hexdigest()[:32]


def snapshot_for_request(request_name: str) -> str:
    """The RBD snapshot name, and the Snapshot document's metadata.name."""
    return "csi-snap-" + hashlib.sha256(request_name.encode()).hexdigest()[:32]


def is_snapshot_name(name: str) -> bool:
    return bool(_SNAP.fullmatch(name))


def snapshot_id(pool: str, image: str, snap: str) -> str:
    """Self-describing like a volume id: any node finds the snapshot from it."""
    sid = f"{SNAP_ID_PREFIX}:{pool}:{image}:{snap}"
    if len(sid.encode()) > MAX_ID_BYTES:
        raise ValueError(f"pool name {quoted(pool)} is too long for a CSI snapshot id")
    return sid


def parse_snapshot_id(sid: str) -> tuple[str, str, str] | None:
    """(pool, image, snap), or None for an id we never hand out."""
    parts = sid.split(":")
    if len(parts) != 4 or parts[0] != SNAP_ID_PREFIX:
        return None
    pool, image, snap = parts[1:]
    if not (_RBD_NAME.fullmatch(pool) and _RBD_NAME.fullmatch(image) and _SNAP.fullmatch(snap)):
        return None
    return pool, image, snap


# -- group snapshots -----------------------------------------------------------
GROUP_ID_PREFIX = "rbdr1g"
MEMBER_ID_PREFIX = "rbdr1gm"
_GROUP = re.compile(r"csi-grp-[0-9a-f]{32}")


def group_for_request(request_name: str) -> str:
    """The RBD group and group snapshot name, and the SnapshotGroup's metadata.name."""
    return "csi-grp-" + hashlib.sha256(request_name.encode()).hexdigest()[:32]


def is_group_name(name: str) -> bool:
    return bool(_GROUP.fullmatch(name))


def group_id(pool: str, group: str) -> str:
    gid = f"{GROUP_ID_PREFIX}:{pool}:{group}"
    if len(gid.encode()) > MAX_ID_BYTES:
        raise ValueError(f"pool name {quoted(pool)} is too long for a CSI group snapshot id")
    return gid


def parse_group_id(gid: str) -> tuple[str, str] | None:
    """(pool, group), or None for an id we never hand out."""
    parts = gid.split(":")
    if len(parts) != 3 or parts[0] != GROUP_ID_PREFIX:
        return None
    if not (_RBD_NAME.fullmatch(parts[1]) and _GROUP.fullmatch(parts[2])):
        return None
    return parts[1], parts[2]


def member_id(pool: str, group: str, image: str) -> str:
    """A snapshot id for one member of a group snapshot: restorable from the id alone."""
    mid = f"{MEMBER_ID_PREFIX}:{pool}:{group}:{image}"
    if len(mid.encode()) > MAX_ID_BYTES:
        raise ValueError(f"pool name {quoted(pool)} is too long for a CSI snapshot id")
    return mid


def parse_member_id(mid: str) -> tuple[str, str, str] | None:
    """(pool, group, image), or None for an id we never hand out."""
    parts = mid.split(":")
    if len(parts) != 4 or parts[0] != MEMBER_ID_PREFIX:
        return None
    pool, group, image = parts[1:]
    if not (_RBD_NAME.fullmatch(pool) and _GROUP.fullmatch(group)
            and _RBD_NAME.fullmatch(image)):
        return None
    return pool, group, image
