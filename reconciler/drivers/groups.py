"""RBD groups through librbd: the group, its members, its snapshot, and a
copy of one member as it was at a group snapshot.

Pacific's groups carry no metadata, so what this reconciler made is recorded
in one small RADOS object per group in the group's pool (``record_oid``): the
creating node, written *before* the group is created, and the node that took
the group snapshot, written before it is taken. A crash between the record
and the librbd call leaves a record of something that may not exist, never
something ours without a record.

Imported by apply/groups.py; csi/cephinfo.py; observe/ceph.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import rados
import rbd

from reconciler.drivers.ceph import ImageExists, make_own
from reconciler.drivers.rbdbase import CephError, feature_bits, image_names, open_image
from reconciler.facts.observed import GroupSnapState, GroupState

RECORD_PREFIX = "rbd-reconciler.group."
# A copy is written under this name and renamed once complete: an interrupted
# copy is never seen under the volume's name (and is removed, then redone).
PARTIAL_SUFFIX = ".rbdr-partial"


class GroupExists(CephError):
    """The group (or its snapshot) is there and was not made by this node."""


def record_oid(group: str) -> str:
    return RECORD_PREFIX + group


def partial_name(image: str) -> str:
    return image + PARTIAL_SUFFIX


def _read_record(ioctx: rados.Ioctx, group: str) -> dict[str, str]:
    try:
        raw = ioctx.read(record_oid(group), 65536)
    except rados.ObjectNotFound:
        return {}
    try:
        data = json.loads(raw.decode() or "{}")
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def _write_record(ioctx: rados.Ioctx, group: str, record: dict[str, str]) -> None:
    ioctx.write_full(record_oid(group), json.dumps(record, sort_keys=True).encode())


def group_state(cluster: rados.Rados, pool: str, name: str) -> GroupState | None:
    """The group as it is (None: no such group); CephError when it cannot be read."""
    try:
        with cluster.open_ioctx(pool) as ioctx:
            if name not in rbd.RBD().group_list(ioctx):
                return None
            pools = {}
            with rbd.Group(ioctx, name) as g:
                images = []
                for i in g.list_images():
                    pid = i["pool"]
                    if pid not in pools:
                        pools[pid] = cluster.pool_reverse_lookup(pid)
                    images.append((pools[pid], i["name"]))
                snaps = tuple(GroupSnapState(s["name"],
                                             s["state"] == rbd.RBD_GROUP_SNAP_STATE_COMPLETE)
                              for s in g.list_snaps())
            record = _read_record(ioctx, name)
    except rados.ObjectNotFound:
        raise CephError(f"pool {pool} does not exist") from None
    except (rados.Error, rbd.Error) as exc:
        raise CephError(f"group {pool}/{name}: {exc}") from exc
    except UnicodeDecodeError as exc:  # a group, member or snapshot name: this group only
        raise CephError(f"group {pool}/{name}: Ceph returned a name that is not UTF-8 text "
                        f"({exc.object[:24]!r})") from None
    return GroupState(pool, name, tuple(sorted(images)), snaps, record.get("owner"),
                      record.get("snap"))


def create_group(cluster: rados.Rados, pool: str, name: str, owner: str) -> str:
    """Record, then create; "ok" when our own group is already there."""
    with cluster.open_ioctx(pool) as ioctx:
        record = _read_record(ioctx, name)
        if name in rbd.RBD().group_list(ioctx):
            if record.get("owner") == owner:
                return "ok"
            raise GroupExists(f"group {pool}/{name} exists and was not created by {owner}")
        _write_record(ioctx, name, {"owner": owner})
        try:
            rbd.RBD().group_create(ioctx, name)
        except rbd.ObjectExists:
            raise GroupExists(f"group {pool}/{name} was created by someone else "
                              "meanwhile") from None
    return "changed"


def add_image(cluster: rados.Rados, pool: str, group: str, image_pool: str,
              image: str) -> None:
    with cluster.open_ioctx(pool) as ioctx, cluster.open_ioctx(image_pool) as iio, \
            rbd.Group(ioctx, group) as g:
        try:
            g.add_image(iio, image)
        except rbd.ObjectExists:
            raise CephError(f"{image_pool}/{image} is already in a group (an image belongs "
                            "to one group at most)") from None


def remove_image(cluster: rados.Rados, pool: str, group: str, image_pool: str,
                 image: str) -> bool:
    """False: it was not a member (any more)."""
    with cluster.open_ioctx(pool) as ioctx, cluster.open_ioctx(image_pool) as iio, \
            rbd.Group(ioctx, group) as g:
        try:
            g.remove_image(iio, image)
        except (rbd.ImageNotFound, rbd.ObjectNotFound):
            return False
    return True


def create_group_snapshot(cluster: rados.Rados, pool: str, group: str, snap: str,
                          owner: str) -> str:
    """Record, then take; "ok" when ours is already there (complete)."""
    with cluster.open_ioctx(pool) as ioctx:
        record = _read_record(ioctx, group)
        with rbd.Group(ioctx, group) as g:
            found = {s["name"]: s["state"] for s in g.list_snaps()}
            if snap in found:
                if record.get("snap") == owner and \
                        found[snap] == rbd.RBD_GROUP_SNAP_STATE_COMPLETE:
                    return "ok"
                raise GroupExists(f"group snapshot {pool}/{group}@{snap} exists and was not "
                                  f"taken by {owner}")
            _write_record(ioctx, group, {**record, "snap": owner})
            g.create_snap(snap)
    return "changed"


def remove_group_snapshot(cluster: rados.Rados, pool: str, group: str, snap: str) -> bool:
    """False: it was already gone."""
    with cluster.open_ioctx(pool) as ioctx:
        with rbd.Group(ioctx, group) as g:
            if snap not in {s["name"] for s in g.list_snaps()}:
                found = False
            else:
                g.remove_snap(snap)
                found = True
        record = _read_record(ioctx, group)
        if record.pop("snap", None) is not None:
            _write_record(ioctx, group, record)
    return found


def remove_group(cluster: rados.Rados, pool: str, group: str) -> bool:
    """The group, then our record of it. False: it was already gone."""
    with cluster.open_ioctx(pool) as ioctx:
        found = group in rbd.RBD().group_list(ioctx)
        if found:
            rbd.RBD().group_remove(ioctx, group)
        with contextlib.suppress(rados.ObjectNotFound):
            ioctx.remove_object(record_oid(group))
    return found


def _group_snap_id(img: rbd.Image, pool_id: int, group: str, snap: str) -> int | None:
    """The id of the image's own snapshot that is part of group snapshot
    ``group@snap`` of pool ``pool_id`` (librbd names it internally, e.g.
    ".group.1_1006..._1006..."; only the id is usable)."""
    for s in img.list_snaps():
        if s.get("namespace") != rbd.RBD_SNAP_NAMESPACE_TYPE_GROUP:
            continue
        ns = img.snap_get_group_namespace(s["id"])
        if ns.get("name") == group and ns.get("snap_name") == snap and \
                ns.get("pool") == pool_id:
            return int(s["id"])
    return None


# Seals a copy's wrapped-passphrase records for the copy: (pool, image of the
# copy, (pool, image) of its source); raises when it cannot.
Seal = Callable[[str, str, tuple[str, str]], None]


def copy_member(cluster: rados.Rados, source: tuple[str, str, str, str], pool: str,
                name: str, features: tuple[str, ...], size: int | None,
                meta: dict[str, str], redo: bool, seal: Seal | None = None) -> None:
    """A full copy of member ``image`` as it was at group snapshot
    ``pool/group@snap`` (``source``: pool, group, snap, image). Pacific's
    clone takes a snapshot *name*, and a group snapshot's per-image snapshots
    have none a caller can use: so a copy, not a COW clone.

    Written as ``partial_name(name)`` and renamed when complete. ``redo``: an
    earlier copy of ours was interrupted (its intent is recorded), so a
    partial image left behind is removed; otherwise a partial image is
    someone else's and the copy is refused. ``seal``: the copy's passphrase
    records sealed for it before the rename (a crash before leaves only the
    partial image, removed and copied again)."""
    spool, group, snap, simage = source
    tmp = partial_name(name)
    with cluster.open_ioctx(pool) as ioctx:
        existing = image_names(ioctx)
        if name in existing:
            raise ImageExists(f"{pool}/{name} already exists (created by someone else since "
                              "it was observed)")
        if tmp in existing:
            if not redo:
                raise ImageExists(f"{pool}/{tmp} exists and no copy of ours was interrupted")
            rbd.RBD().remove(ioctx, tmp)
        with cluster.open_ioctx(spool) as sio, open_image(sio, simage, read_only=True) as src:
            snap_id = _group_snap_id(src, sio.get_pool_id(), group, snap)
            if snap_id is None:
                raise CephError(f"{spool}/{simage} has no snapshot of group snapshot "
                                f"{spool}/{group}@{snap} (not a member when it was taken)")
            src.set_snap_by_id(snap_id)
            if size is not None and size < src.size():
                raise CephError(f"a restore may be larger than its source, never smaller: "
                                f"{spool}/{simage} was {src.size()} bytes at the snapshot")
            src.copy(ioctx, tmp, features=feature_bits(features))
        try:
            with open_image(ioctx, tmp) as img:
                make_own(ioctx, img, meta, size)  # as for a clone
            if seal is not None:
                seal(pool, tmp, (spool, simage))
            rbd.RBD().rename(ioctx, tmp, name)
        except Exception:
            with contextlib.suppress(rbd.Error):
                rbd.RBD().remove(ioctx, tmp)  # never leave a copy nobody owns
            raise


def snapshot_members(cluster: rados.Rados, pool: str, group: str, snap: str
                     ) -> dict[str, tuple[int, float]] | None:
    """Each member image of a complete group snapshot: (size, creation time)
    of its part of it. None: no such group, or no complete snapshot."""
    try:
        with cluster.open_ioctx(pool) as ioctx:
            if group not in rbd.RBD().group_list(ioctx):
                return None
            with rbd.Group(ioctx, group) as g:
                if not any(s["name"] == snap and s["state"] == rbd.RBD_GROUP_SNAP_STATE_COMPLETE
                           for s in g.list_snaps()):
                    return None
                images = [i["name"] for i in g.list_images()]
            out = {}
            for name in images:
                with contextlib.suppress(rbd.ImageNotFound), \
                        open_image(ioctx, name, read_only=True) as img:
                    sid = _group_snap_id(img, ioctx.get_pool_id(), group, snap)
                    if sid is None:
                        continue  # added after the snapshot was taken
                    size = next(int(s["size"]) for s in img.list_snaps() if s["id"] == sid)
                    out[name] = (size, img.get_snap_timestamp(sid).timestamp())
            return out
    except rados.ObjectNotFound:
        return None
