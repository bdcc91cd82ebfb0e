"""Ceph through librbd/librados (Debian's python3-rados and python3-rbd): the
connection, and what the engine does to images: observe, create, resize,
remove, set their image-meta and QoS, snapshot, clone and flatten.

Imported by the layers above drivers that act on Ceph (apply/, observe/,
csi/, cli/); the primitives below it are drivers/rbdbase.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import rados
import rbd

from reconciler.drivers import omap
from reconciler.drivers.keys import ImageRef
from reconciler.drivers.rbdbase import (
    MAX_DEPTH_WALK,
    MAX_META,
    META_PREFIX,
    OP_TIMEOUT_S,
    OPENS,
    CephError,
    UnreadableMeta,
    feature_bits,
    header_oid,
    image_meta,
    image_names,
    image_state,
    list_images,
    meta_cas,
    meta_set_absent,
    object_exists,
    open_image,
    operate_compared,
    parent_of,
)
from reconciler.facts import meta as metakeys
from reconciler.facts.observed import ImageState
from reconciler.spec.config import CephConfig


class ImageExists(CephError):
    """The image to create is already there: someone else's, never ours to claim."""

@contextlib.contextmanager
def connect(cfg: CephConfig, timeout: int = OP_TIMEOUT_S) -> Iterator[rados.Rados]:
    _readable("Ceph conf", cfg.conf)
    if cfg.keyring:
        _readable("keyring", cfg.keyring)
    conf = {"rados_mon_op_timeout": str(timeout), "rados_osd_op_timeout": str(timeout),
            "client_mount_timeout": str(timeout)}
    if cfg.keyring:
        conf["keyring"] = cfg.keyring
    try:
        cluster = rados.Rados(conffile=cfg.conf, rados_id=cfg.user, conf=conf)
    except (rados.Error, OSError) as exc:
        raise CephError(f"Ceph conf {cfg.conf}: {exc}") from exc
    try:
        cluster.connect(timeout=timeout)
    except (rados.Error, OSError) as exc:
        why = _why_not_connected(cluster, cfg, timeout, exc)
        cluster.shutdown()
        raise CephError(why) from exc
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _readable(what: str, path: str) -> None:
    """librados says only "object not found" for a missing file: name it."""
    try:
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        raise CephError(f"{what} {path}: not found") from None
    except PermissionError:
        raise CephError(f"{what} {path}: permission denied (run as root?)") from None
    except OSError as exc:
        raise CephError(f"{what} {path}: cannot read: {exc.strerror}") from None


def _why_not_connected(cluster: rados.Rados, cfg: CephConfig, timeout: int,
                       exc: Exception) -> str:
    """One line that names what to look at: the monitors, or the keyring."""
    def conf_get(key: str) -> str:
        try:
            return cluster.conf_get(key) or ""
        except rados.Error:
            return ""

    mon_host = conf_get("mon_host")
    client = f"client.{cfg.user}"
    if isinstance(exc, rados.TimedOut):
        return (f"Ceph did not answer within {timeout} s (mon host {mon_host or '?'}, "
                f"from {cfg.conf}, as {client})")
    if isinstance(exc, rados.ObjectNotFound):
        if not mon_host:
            return f"Ceph conf {cfg.conf} names no monitor (mon host)"
        keyrings = [k for k in conf_get("keyring").split(",") if k]
        if not any(os.path.exists(k) for k in keyrings):
            return f"no keyring for {client}: looked for {', '.join(keyrings) or 'none'}"
    if isinstance(exc, rados.PermissionDeniedError | rados.PermissionError):
        return (f"Ceph refused {client} (keyring {cfg.keyring or conf_get('keyring')}): "
                f"{exc}")
    return f"cannot connect to Ceph ({cfg.conf}, {client}, mon host {mon_host or '?'}): {exc}"


@dataclass
class Images:
    images: dict[tuple[str, str], ImageState]
    listed: set[str]
    errors: dict[str, str]


def observe_images(cluster: rados.Rados, wanted: Iterable[tuple[str, str]]) -> Images:
    """One listing per pool, then details only of the images we care about."""
    by_pool: dict[str, set[str]] = {}
    for pool, name in wanted:
        by_pool.setdefault(pool, set()).add(name)
    out = Images({}, set(), {})
    for pool in sorted(by_pool):
        try:
            out.images.update(observe_pool(cluster, pool, by_pool[pool]))
        except CephError as exc:
            out.errors[pool] = str(exc)
            continue
        out.listed.add(pool)
    return out


def observe_pool(cluster: rados.Rados, pool: str,
                 names: Iterable[str]) -> dict[tuple[str, str], ImageState]:
    """The wanted images that exist in one pool; CephError if it cannot be listed."""
    out = {}
    for name in sorted(set(names) & list_images(cluster, pool)):
        state = image_state(cluster, pool, name)
        if state is not None:
            out[(pool, name)] = state
    return out

def create_image(cluster: rados.Rados, pool: str, name: str, size: int,
                 features: Iterable[str], meta: dict[str, str]) -> None:
    with cluster.open_ioctx(pool) as ioctx:
        try:
            rbd.RBD().create(ioctx, name, size, old_format=False,
                             features=feature_bits(features))
        except rbd.ImageExists:
            raise ImageExists(f"{pool}/{name} already exists (created by someone else "
                              "since it was observed)") from None
        try:
            oid = header_oid(ioctx, name)
            if oid is None or not meta_set_absent(ioctx, oid, meta):
                for k, v in meta.items():
                    if oid is not None:
                        meta_cas(ioctx, oid, k, v)
                    else:
                        with open_image(ioctx, name) as img:
                            img.metadata_set(k, v)
        except Exception:
            # An image without its owner record could never be deleted by us:
            # remove it now rather than leak it.
            rbd.RBD().remove(ioctx, name)
            raise


def remove_unlisted(cluster: rados.Rados, pool: str, name: str) -> bool:
    """Remove the remains of a create that died half-way: the name is taken
    (its id object exists) but the image is not in the pool's directory, or
    it is listed but has no header object yet (librbd adds the directory
    entry before it writes the header: such an image cannot be opened, so
    no data was ever written to it). False, touching nothing, for a real
    image (listed, with its header)."""
    with cluster.open_ioctx(pool) as ioctx:
        if name in image_names(ioctx):
            oid = header_oid(ioctx, name)
            if oid is None:
                # Listed without an id object: a create killed right after
                # its directory entry (seen under load in CI; nothing but
                # the entry exists). An id object we cannot read, or a
                # format-1 image (listed, its header NAME.rbd, no id
                # object) is a real one: never touched.
                if object_exists(ioctx, f"rbd_id.{name}") or object_exists(ioctx, f"{name}.rbd"):
                    return False
            elif object_exists(ioctx, oid):
                return False  # a real image; else its create died before the header
        # librbd's remove clears the id object (and any header) of such an
        # image, then reports ImageNotFound for the part that never existed.
        with contextlib.suppress(rbd.ImageNotFound):
            rbd.RBD().remove(ioctx, name)
    return True


def resize_image(cluster: rados.Rados, pool: str, name: str, size: int) -> None:
    with cluster.open_ioctx(pool) as ioctx, open_image(ioctx, name) as img:
        if size < img.size():
            raise CephError(f"refusing to shrink {pool}/{name}")
        img.resize(size, allow_shrink=False)
def set_meta(cluster: rados.Rados, pool: str, name: str, key: str, value: str) -> None:
    with cluster.open_ioctx(pool) as ioctx:
        oid = None if key.startswith("conf_") else header_oid(ioctx, name)
        if oid is not None:
            meta_cas(ioctx, oid, key, value)
            return
        with open_image(ioctx, name) as img:
            img.metadata_set(key, value)


def set_meta_once(cluster: rados.Rados, pool: str, name: str, key: str, value: str) -> str:
    """Set ``key`` only if it is absent; returns the value that stands (ours,
    or one another process set first). Two nodes racing to seal a volume's
    passphrase end with one passphrase, never two."""
    with cluster.open_ioctx(pool) as ioctx:
        oid = header_oid(ioctx, name)
        if oid is None:
            raise CephError(f"{pool}/{name} has no header object (RBD format 1?): image-meta "
                            "cannot be set once")
        omap_key = META_PREFIX + key
        with rados.WriteOpCtx() as op:
            op.omap_cmp(omap_key, "", rados.LIBRADOS_CMPXATTR_OP_EQ)
            ioctx.set_omap(op, (omap_key,), (value.encode(),))
            try:
                ioctx.operate_write_op(op, oid)
                return value
            except rados.ObjectNotFound:
                raise rbd.ImageNotFound(f"{oid} is gone") from None
            except rados.Error:
                pass  # set already: read what stands
    stands = get_meta(cluster, pool, name).get(key)
    if stands is None:
        raise CephError(f"image-meta {key} of {pool}/{name} could not be set; try again")
    return stands


def update_meta(cluster: rados.Rados, pool: str, name: str, expect: dict[str, str | None],
                changes: dict[str, str | None]) -> bool:
    """Several of our image-meta keys changed in one RADOS write op on the
    header object, atomic in the OSD: every key of ``expect`` still holds its
    value (None: absent) and all of ``changes`` are made (None: removed), or
    nothing is. False when a compare failed (someone changed a key since it
    was read). librbd keeps image-meta as these ``metadata_<key>`` omap keys
    and reads them from the OSD on every get: nothing of it is cached."""
    with cluster.open_ioctx(pool) as ioctx:
        oid = header_oid(ioctx, name)
        if oid is None:
            raise CephError(f"{pool}/{name} has no header object (RBD format 1?): image-meta "
                            "cannot be changed atomically")
        with rados.WriteOpCtx() as op:
            for key, value in expect.items():
                # An absent key compares equal to "": ours are never empty.
                op.omap_cmp(META_PREFIX + key, value or "", rados.LIBRADOS_CMPXATTR_OP_EQ)
            sets = {META_PREFIX + k: v.encode() for k, v in changes.items() if v is not None}
            gone = [META_PREFIX + k for k, v in changes.items() if v is None]
            if sets:
                ioctx.set_omap(op, tuple(sets), tuple(sets.values()))
            if gone:
                ioctx.remove_omap_keys(op, tuple(gone))
            return operate_compared(ioctx, op, oid, f"{pool}/{name}")


def image_ref(cluster: rados.Rados, pool: str, name: str) -> ImageRef:
    """The image's lasting identity (pool id, image id), from its id object:
    one read, no open."""
    with cluster.open_ioctx(pool) as ioctx:
        oid = header_oid(ioctx, name)
        if oid is None:
            raise CephError(f"{pool}/{name} has no image id (RBD format 1, or gone)")
        return ImageRef(ioctx.get_pool_id(), oid.removeprefix("rbd_header."))


def lineage(cluster: rados.Rados, pool: str, name: str) -> list[ImageRef]:
    """The image's parents as Ceph's own parent links name them, nearest
    first (at most MAX_DEPTH_WALK). Image-meta never enters into it: a record
    claiming a parent proves nothing, the header's parent link does."""
    out: list[ImageRef] = []
    pool_name, namespace, name_, id_ = pool, "", name, None
    while len(out) < MAX_DEPTH_WALK:
        with cluster.open_ioctx(pool_name) as ioctx:
            if namespace:
                ioctx.set_namespace(namespace)
            OPENS[0] += 1
            with rbd.Image(ioctx, name_, image_id=id_, read_only=True) as img:
                try:
                    spec, parent_id = img.get_parent_image_spec(), img.parent_id()
                except rbd.ImageNotFound:  # no parent
                    return out
        # By id: a parent renamed (or moved to the trash) is still the parent.
        pool_name, namespace = spec["pool_name"], spec.get("pool_namespace") or ""
        name_, id_ = None, parent_id
        pool_id = cluster.pool_lookup(pool_name)
        if pool_id is None:
            break
        out.append(ImageRef(pool_id, parent_id))
    return out


def remove_meta(cluster: rados.Rados, pool: str, name: str, key: str) -> None:
    with cluster.open_ioctx(pool) as ioctx:
        oid = None if key.startswith("conf_") else header_oid(ioctx, name)
        if oid is not None:
            meta_cas(ioctx, oid, key, None)
            return
        with open_image(ioctx, name) as img, contextlib.suppress(KeyError, rbd.ObjectNotFound):
            img.metadata_remove(key)


def set_qos(cluster: rados.Rados, pool: str, name: str, keys: tuple[str, ...],
            want: dict[str, str]) -> None:
    """librbd's QoS keys of ``keys`` as ``want`` says (absent: removed), in
    one open. Through librbd, not the header omap: it checks each value and
    tells every client with the image open (their limits change live)."""
    with cluster.open_ioctx(pool) as ioctx, open_image(ioctx, name) as img:
        values, unreadable = image_meta(ioctx, img)
        if bad := sorted(k for k in unreadable if k in keys):
            raise UnreadableMeta(f"{pool}/{name}: image-meta {', '.join(bad)} is not UTF-8 "
                                 "text; not changed")
        have = {k: v for k, v in values.items() if k in keys}
        done: list[str] = []
        try:
            for key in keys:
                if key in want and have.get(key) != want[key]:
                    img.metadata_set(key, want[key])
                    done.append(key)
                elif key not in want and key in have:
                    with contextlib.suppress(KeyError, rbd.ObjectNotFound):
                        img.metadata_remove(key)
                    done.append(key)
        except BaseException:
            # A value librbd refused half-way: the previous set of limits
            # back, never a mix of old and new.
            for key in reversed(done):
                with contextlib.suppress(Exception):
                    if key in have:
                        img.metadata_set(key, have[key])
                    else:
                        img.metadata_remove(key)
            raise


def get_meta(cluster: rados.Rados, pool: str, name: str) -> dict[str, str]:
    """Every image-meta key, in one read. UnreadableMeta when one of ours
    is not UTF-8 text."""
    with cluster.open_ioctx(pool) as ioctx:
        oid = header_oid(ioctx, name)
        if oid is not None:
            with rados.ReadOpCtx() as rop:
                it, _ = ioctx.get_omap_vals(rop, "", META_PREFIX, MAX_META)
                try:
                    ioctx.operate_read_op(rop, oid)
                except rados.ObjectNotFound:
                    raise rbd.ImageNotFound(f"{pool}/{name} is gone") from None
                vals, skipped = omap.entries(it)
            if len(vals) + len(skipped) < MAX_META:
                return _ours_readable(pool, name, metakeys.decode(
                    {k[len(META_PREFIX):]: v for k, v in vals.items()}))
        with open_image(ioctx, name, read_only=True) as img:
            return _ours_readable(pool, name, image_meta(ioctx, img))


def _ours_readable(pool: str, name: str, decoded: tuple[dict[str, str], dict[str, str]]
                   ) -> dict[str, str]:
    """The values; UnreadableMeta when one of our keys is not text (another
    tool's key that is not is left out: we never read it)."""
    values, unreadable = decoded
    if bad := sorted(k for k in unreadable if metakeys.ours(k)):
        raise UnreadableMeta(f"{pool}/{name}: image-meta {', '.join(bad)} is not UTF-8 "
                             f"text ({unreadable[bad[0]]})")
    return values

class _Found(Exception):
    pass


def has_data(cluster: rados.Rados, pool: str, name: str) -> bool:
    """Whether any block of the image was ever written (an allocated object).
    Stops at the first one; with object-map this reads no data objects."""
    def found(_offset: int, _length: int, exists: bool) -> None:
        if exists:
            raise _Found

    with cluster.open_ioctx(pool) as ioctx, open_image(ioctx, name, read_only=True) as img:
        try:
            img.diff_iterate(0, img.size(), None, found, whole_object=True)
        except _Found:
            return True
    return False


def remove_image(cluster: rados.Rados, pool: str, name: str) -> None:
    with cluster.open_ioctx(pool) as ioctx:
        # librbd itself refuses (EBUSY) while any client still watches the image.
        rbd.RBD().remove(ioctx, name)


# -- snapshots and clones --------------------------------------------------------
class SnapshotExists(CephError):
    """The snapshot to take is already there and is not ours."""


def create_snapshot(cluster: rados.Rados, pool: str, image: str, snap: str,
                    owner: str) -> str:
    """Take ``snap``; returns "changed", or "ok" when our own is already there
    (a crash after the snapshot). The owner record is written first, so a
    crash never leaves a snapshot we made but cannot prove ours."""
    key = metakeys.snap_owner(snap)
    with cluster.open_ioctx(pool) as ioctx, open_image(ioctx, image) as img:
        values, unreadable = image_meta(ioctx, img)
        if key in unreadable:
            raise UnreadableMeta(f"{pool}/{image}: image-meta {key} is not UTF-8 text "
                                 f"({unreadable[key]})")
        had = values.get(key)
        exists = any(s["name"] == snap for s in img.list_snaps())
        if exists:
            if had == owner:
                return "ok"
            raise SnapshotExists(f"{pool}/{image}@{snap} exists and was not made by {owner}")
        img.metadata_set(key, owner)
        try:
            img.create_snap(snap)
        except rbd.ImageExists:
            if had != owner:
                with contextlib.suppress(KeyError, rbd.Error):
                    img.metadata_remove(key)
            raise SnapshotExists(f"{pool}/{image}@{snap} was created by someone else "
                                 "meanwhile") from None
    return "changed"


def remove_snapshot(cluster: rados.Rados, pool: str, image: str, snap: str) -> bool:
    """Unprotect and remove; False when it was already gone. librbd refuses
    (ImageBusy) while a clone still depends on it."""
    with cluster.open_ioctx(pool) as ioctx, open_image(ioctx, image) as img:
        if not any(s["name"] == snap for s in img.list_snaps()):
            found = False
        else:
            found = True
            if img.is_protected_snap(snap):
                img.unprotect_snap(snap)
            img.remove_snap(snap)
        with contextlib.suppress(KeyError, rbd.Error):
            img.metadata_remove(metakeys.snap_owner(snap))
    return found

def make_own(ioctx: rados.Ioctx, img: rbd.Image, meta: dict[str, str],
             size: int | None) -> None:
    """A new clone or copy: librbd copied its source's image-meta, and what
    described the source goes (the filesystem and LUKS records stay true);
    ``meta`` is set and the image grown to ``size``."""
    values, unreadable = image_meta(ioctx, img)
    for k in [*values, *unreadable]:
        if k in metakeys.PARENT_ONLY or k.startswith(metakeys.SNAP_PREFIX):
            img.metadata_remove(k)
    for k, v in meta.items():
        img.metadata_set(k, v)
    if size is not None and size > img.size():
        img.resize(size, allow_shrink=False)


def clone_image(cluster: rados.Rados, parent: tuple[str, str, str], pool: str, name: str,
                features: Iterable[str], size: int | None, meta: dict[str, str]) -> None:
    """An RBD clone of ``parent`` (pool, image, snap), grown to ``size``. The
    parent snapshot is protected first (clone format 1 needs it; harmless for 2)."""
    ppool, pimage, psnap = parent
    with cluster.open_ioctx(ppool) as pio, open_image(pio, pimage) as pimg:
        if not pimg.is_protected_snap(psnap):
            pimg.protect_snap(psnap)
    with cluster.open_ioctx(pool) as ioctx:
        try:
            with cluster.open_ioctx(ppool) as pio:
                rbd.RBD().clone(pio, pimage, psnap, ioctx, name,
                                features=feature_bits(features))
        except rbd.ImageExists:
            raise ImageExists(f"{pool}/{name} already exists (created by someone else "
                              "since it was observed)") from None
        try:
            with open_image(ioctx, name) as img:
                make_own(ioctx, img, meta, size)
        except Exception:
            rbd.RBD().remove(ioctx, name)  # never leak a clone nobody owns
            raise


def flatten_image(cluster: rados.Rados, pool: str, name: str) -> bool:
    """Copy the parent's data in: the image no longer depends on a snapshot.
    False when it already did not."""
    with cluster.open_ioctx(pool) as ioctx, open_image(ioctx, name) as img:
        if parent_of(img) is None:
            return False
        img.flatten()
    return True
