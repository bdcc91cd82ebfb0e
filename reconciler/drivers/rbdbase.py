"""What drivers/ceph.py builds on, through librbd/librados: the errors, the
feature names, the counted librbd open, a pool's listing and an image's
state as observe reads it, the header object's image-meta (read, and set
by compare-and-set without opening the image), a snapshot's clones, and
Ceph's blocklist.

Imported by drivers/ceph.py, drivers/groups.py, drivers/rbdheader.py, and
by what reads Ceph directly (observe/ceph.py, apply/claims.py, csi/cephinfo.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import threading
from collections.abc import Iterable, Iterator

import rados
import rbd

from reconciler.drivers import omap
from reconciler.facts import meta as metakeys
from reconciler.facts.claim import parse_blocklist
from reconciler.facts.observed import ImageState, SnapState

FEATURE_BITS = {
    "layering": rbd.RBD_FEATURE_LAYERING,
    "exclusive-lock": rbd.RBD_FEATURE_EXCLUSIVE_LOCK,
    "object-map": rbd.RBD_FEATURE_OBJECT_MAP,
    "fast-diff": rbd.RBD_FEATURE_FAST_DIFF,
    "deep-flatten": rbd.RBD_FEATURE_DEEP_FLATTEN,
    "journaling": rbd.RBD_FEATURE_JOURNALING,
    "striping": rbd.RBD_FEATURE_STRIPINGV2,
    "data-pool": rbd.RBD_FEATURE_DATA_POOL,
}

# Without these librados waits forever for a cluster that is down.
OP_TIMEOUT_S = 30


class CephError(Exception):
    pass


class UnreadableMeta(CephError):
    """One of our image-meta values is not UTF-8 text: never read as absent,
    never compared or overwritten."""


def feature_names(bits: int) -> frozenset[str]:
    return frozenset(n for n, b in FEATURE_BITS.items() if bits & b)


def feature_bits(names: Iterable[str]) -> int:
    out = 0
    for n in names:
        out |= FEATURE_BITS[n]
    return out


def list_images(cluster: rados.Rados, pool: str) -> set[str]:
    try:
        with cluster.open_ioctx(pool) as ioctx:
            return image_names(ioctx)
    except rados.ObjectNotFound:
        raise CephError("pool does not exist") from None
    except (rados.Error, rbd.Error) as exc:
        raise CephError(str(exc)) from exc


def image_names(ioctx: rados.Ioctx) -> set[str]:
    """The pool's images. librbd's listing fails as a whole on one name that
    is not UTF-8 (anyone may create one): then the directory is read
    directly, and such a name, never ours, is left out."""
    try:
        return set(rbd.RBD().list(ioctx))
    except UnicodeDecodeError:
        pass
    if ioctx.stat("rbd_directory")[0]:
        # Format-1 images are listed in the object's data, which only librbd reads.
        raise CephError("an image name that is not UTF-8 text beside format-1 images: "
                        "the pool cannot be listed")
    try:
        found, _ = omap.scan(ioctx, "rbd_directory", "name_")
    except omap.Unpageable as exc:
        raise CephError(str(exc)) from None
    return {k[len("name_"):] for k in found}


def image_state(cluster: rados.Rados, pool: str, name: str) -> ImageState | None:
    """None: the image is gone (removed since it was listed)."""
    try:
        with cluster.open_ioctx(pool) as ioctx:
            return _image_state(cluster, ioctx, pool, name)
    except (rados.Error, rbd.Error) as exc:
        raise CephError(f"{pool}/{name}: {exc}") from exc
    except UnicodeDecodeError as exc:
        # A snapshot, parent or clone name librbd's binding cannot decode:
        # this image is unknown, no other.
        raise CephError(f"{pool}/{name}: Ceph returned a name that is not UTF-8 text "
                        f"({metakeys.preview(exc.object)})") from None


def _image_state(cluster: rados.Rados, ioctx: rados.Ioctx, pool: str,
                 name: str) -> ImageState | None:
    try:
        # Read-only opens register no watch, so we never count ourselves.
        with open_image(ioctx, name, read_only=True) as img:
            watchers = tuple(sorted(w["addr"] for w in img.watchers_list()))
            parent = parent_of(img)
            values, unreadable = image_meta(ioctx, img)
            return ImageState(pool=pool, name=name, size=img.size(),
                              features=feature_names(img.features()),
                              meta=values, unreadable=unreadable, watchers=watchers,
                              snaps=_snaps(img), parent=parent,
                              depth=_depth(cluster, parent) if parent else 0)
    except rbd.ImageNotFound:  # removed between list and open
        return None


def image_meta(ioctx: rados.Ioctx, img: rbd.Image) -> tuple[dict[str, str], dict[str, str]]:
    """An open image's image-meta as ``meta.decode`` gives it. librbd's
    listing fails as a whole on one value that is not UTF-8: then the header
    omap, where librbd keeps it, is read directly."""
    try:
        return dict(img.metadata_list()), {}
    except UnicodeDecodeError:
        pass
    try:
        found, _ = omap.scan(ioctx, f"rbd_header.{img.id()}", META_PREFIX)
    except omap.Unpageable as exc:
        raise CephError(str(exc)) from None
    return metakeys.decode({k[len(META_PREFIX):]: v for k, v in found.items()})


def parent_of(img: rbd.Image) -> str | None:
    try:
        p = img.get_parent_image_spec()
    except rbd.ImageNotFound:
        return None
    return f"{p['pool_name']}/{p['image_name']}@{p['snap_name']}"


def _snaps(img: rbd.Image) -> tuple[SnapState, ...]:
    """Each snapshot with its clones. Only images with snapshots pay for it."""
    out = []
    for s in list(img.list_snaps()):
        if s.get("namespace", 0) != 0:  # trash or mirror snapshots are not ours to show
            continue
        img.set_snap(s["name"])
        try:
            children = tuple(sorted(f"{c['pool']}/{c['image']}" for c in img.list_children2()
                                    if not c.get("trash")))
            protected = img.is_protected_snap(s["name"])
        finally:
            img.set_snap(None)
        out.append(SnapState(s["name"], s["size"], img.get_snap_timestamp(s["id"]).timestamp(),
                             protected, children))
    return tuple(out)


MAX_DEPTH_WALK = 64  # deeper than any chain librbd would let anyone build


def _depth(cluster: rados.Rados, parent: str) -> int:
    """How many images a clone reads through: its parent's depth plus one."""
    depth, spec = 0, parent
    while spec and depth < MAX_DEPTH_WALK:
        depth += 1
        pool, _, rest = spec.partition("/")
        image = rest.partition("@")[0]
        try:
            with cluster.open_ioctx(pool) as pio, open_image(pio, image, read_only=True) as img:
                spec = parent_of(img) or ""
        except (rados.Error, rbd.Error):
            break
    return depth


# Image-meta is the header object's omap (key ``metadata_<key>``), which
# librbd reads from the OSD on every metadata_get: our own keys are read and
# written there with rados ops, without opening the image (an open costs
# ~4 ms and several round trips). librbd's config overrides (``conf_*``),
# which an open image applies, and format-1 images go through librbd.
META_PREFIX = "metadata_"
MAX_META = 4096


def object_exists(ioctx: rados.Ioctx, oid: str) -> bool:
    try:
        ioctx.stat(oid)
    except rados.ObjectNotFound:
        return False
    return True


def header_oid(ioctx: rados.Ioctx, name: str) -> str | None:
    """``rbd_header.<id>`` from the image's id object; None: no id object (a
    format-1 image, or none at all): use librbd."""
    try:
        raw = ioctx.read(f"rbd_id.{name}", 4096)
    except rados.ObjectNotFound:
        return None
    if len(raw) < 5 or int.from_bytes(raw[:4], "little") != len(raw) - 4:
        return None
    try:
        return f"rbd_header.{raw[4:].decode()}"
    except UnicodeDecodeError:
        raise CephError(f"{name}: its id (rbd_id.{name}) is not UTF-8 text "
                        f"({metakeys.preview(raw[4:])})") from None


def meta_set_absent(ioctx: rados.Ioctx, oid: str, values: dict[str, str]) -> bool:
    """Set every key of ``values`` in one write, each compared absent (a new
    image's records: one round trip, not two a key). False when one was
    there already (nothing written: the caller sets them one by one)."""
    if not values:
        return True
    with rados.WriteOpCtx() as op:
        for key in values:  # an absent key compares equal to "": ours are never empty
            op.omap_cmp(META_PREFIX + key, "", rados.LIBRADOS_CMPXATTR_OP_EQ)
        ioctx.set_omap(op, tuple(META_PREFIX + k for k in values),
                       tuple(v.encode() for v in values.values()))
        return operate_compared(ioctx, op, oid, oid)


def operate_compared(ioctx: rados.Ioctx, op: rados.WriteOp, oid: str, what: str) -> bool:
    """Run a write op that holds compares; False when one failed (nothing
    was written), ImageNotFound when the header is gone."""
    try:
        ioctx.operate_write_op(op, oid)
    except rados.ObjectNotFound:
        raise rbd.ImageNotFound(f"{what} is gone") from None
    except rados.Error as exc:
        if getattr(exc, "errno", None) == errno.ECANCELED:
            return False
        raise
    return True


def meta_cas(ioctx: rados.Ioctx, oid: str, key: str, value: str | None) -> None:
    """Set (None: remove) one key, compared against what was just read, so
    the write never creates a header (the compare fails on a missing object)
    and never loses a concurrent change of the same key."""
    omap_key = META_PREFIX + key
    for _ in range(5):
        with rados.ReadOpCtx() as rop:
            it, _ = ioctx.get_omap_vals_by_keys(rop, (omap_key,))
            try:
                ioctx.operate_read_op(rop, oid)
            except rados.ObjectNotFound:
                raise rbd.ImageNotFound(f"{oid} is gone") from None
            old = omap.entries(it)[0].get(omap_key)
        try:
            expect = metakeys.text(key, old or b"")
        except metakeys.Unreadable as exc:
            raise UnreadableMeta(f"{oid}: {exc}; not changed") from None
        with rados.WriteOpCtx() as op:
            op.omap_cmp(omap_key, expect, rados.LIBRADOS_CMPXATTR_OP_EQ)
            if value is None:
                ioctx.remove_omap_keys(op, (omap_key,))
            else:
                ioctx.set_omap(op, (omap_key,), (value.encode(),))
            try:
                ioctx.operate_write_op(op, oid)
                return
            except rados.ObjectNotFound:
                raise rbd.ImageNotFound(f"{oid} is gone") from None
            except rados.Error:
                continue  # changed between the read and the write: again
    raise CephError(f"image-meta {key} of {oid} kept changing; try again")

# Every librbd open of an image in this process, for the benchmark and tests
# that hold us to one open per volume chain.
OPENS = [0]


# One writable handle per image in this process at a time. librbd 16.2
# (Debian 12) aborts the whole process (``~AsyncOpTracker``: FAILED
# ceph_assert(m_pending_ops == 0)) when handles of one image in one client
# pass its exclusive lock among themselves while one closes: a teardown that
# removed three snapshots of one image in parallel chains did, in CI. Ceph
# would run such changes one after the other anyway (the exclusive lock), so
# waiting here costs nothing; images that differ never wait for each other.
_WRITERS: dict[tuple[str, str, str], tuple[threading.Lock, int]] = {}
_WRITERS_LOCK = threading.Lock()


@contextlib.contextmanager
def _sole_writer(ioctx: rados.Ioctx, name: str) -> Iterator[None]:
    key = (ioctx.get_pool_name(), ioctx.get_namespace(), name)
    with _WRITERS_LOCK:
        lock, users = _WRITERS.get(key) or (threading.Lock(), 0)
        _WRITERS[key] = (lock, users + 1)
    try:
        with lock:
            yield
    finally:
        with _WRITERS_LOCK:
            lock, users = _WRITERS[key]
            if users == 1:
                del _WRITERS[key]
            else:
                _WRITERS[key] = (lock, users - 1)


@contextlib.contextmanager
def open_image(ioctx: rados.Ioctx, name: str, read_only: bool = False,
               snapshot: str | None = None) -> Iterator[rbd.Image]:
    """An open image, closed on leaving; a writable one is this process's only
    writable handle of that image meanwhile (see _WRITERS)."""
    with contextlib.ExitStack() as stack:
        if not read_only:
            stack.enter_context(_sole_writer(ioctx, name))
        OPENS[0] += 1
        with rbd.Image(ioctx, name, snapshot=snapshot, read_only=read_only) as img:
            yield img

def snapshot_children(cluster: rados.Rados, pool: str, image: str, snap: str) -> list[str]:
    with cluster.open_ioctx(pool) as ioctx, open_image(ioctx, image, read_only=True,
                                                     snapshot=snap) as img:
        return sorted(f"{c['pool']}/{c['image']}" for c in img.list_children2()
                      if not c.get("trash"))

def blocklist(cluster: rados.Rados, timeout: float = OP_TIMEOUT_S) -> dict[str, str]:
    """Ceph's blocklist: client address -> until (one mon command)."""
    rc, out, err = cluster.mon_command(
        json.dumps({"prefix": "osd blocklist ls", "format": "json"}), b"", timeout=int(timeout))
    if rc != 0:
        raise CephError(f"ceph osd blocklist ls: {err or rc}")
    return parse_blocklist(out.decode(errors="replace"))
