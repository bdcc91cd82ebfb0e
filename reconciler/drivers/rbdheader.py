"""An image's size, features and image-meta in one rados read of its header.

Opening an image with librbd costs ~4.4 ms and several round trips (id,
header, snap context, parent, lock state, config overrides); the header
object's omap holds what observe needs (RBD format 2: ``size`` and
``features`` as little-endian u64, ``metadata_<key>`` as raw bytes), read in
~0.2 ms (a pool's headers are read together: one asynchronous read each,
issued at once). Used for observing only, for images whose watchers are not needed;
anything unexpected (no id, a missing key, too many keys) is ``Fallback``:
the caller opens the image with librbd as before. An image-meta value that
is not UTF-8 is not unexpected: it is reported in ``unreadable``, for that
key alone (librbd's binding would fail the whole image on it).

Imported by observe/ceph.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
from collections.abc import Callable, Iterable

import rados

from reconciler.drivers import omap
from reconciler.drivers.rbdbase import CephError, feature_names
from reconciler.facts import meta as metakeys
from reconciler.facts.observed import ImageState

MAX_META = 4096


class Fallback(Exception):
    """Not answerable from the header: open the image with librbd."""


def decode_string(raw: bytes) -> str:
    """A Ceph-encoded string: u32 little-endian length, then the bytes."""
    if len(raw) < 4 or int.from_bytes(raw[:4], "little") != len(raw) - 4:
        raise Fallback("not an encoded string")
    try:
        return raw[4:].decode()
    except UnicodeDecodeError:
        raise Fallback("an encoded string that is not UTF-8") from None


def image_ids(cluster: rados.Rados, pool: str, names: Iterable[str]) -> dict[str, str]:
    """name -> image id from the pool's rbd_directory, for ``names``, in one read."""
    keys = tuple(f"name_{n}" for n in names)
    if not keys:
        return {}
    with cluster.open_ioctx(pool) as ioctx, rados.ReadOpCtx() as op:
        it, _ = ioctx.get_omap_vals_by_keys(op, keys)
        ioctx.operate_read_op(op, "rbd_directory")
        out = {}
        for k, v in omap.entries(it)[0].items():
            try:
                out[k[len("name_"):]] = decode_string(v)
            except Fallback:
                continue
        return out


def parse_header(pool: str, name: str, fixed: dict[str, bytes],
                 meta: dict[str, bytes], skipped: int = 0) -> ImageState:
    """``skipped``: image-meta keys read that are not UTF-8 (never ours)."""
    if len(fixed.get("size", b"")) != 8 or len(fixed.get("features", b"")) != 8:
        raise Fallback("header without size/features")
    if len(meta) + skipped >= MAX_META:
        raise Fallback("too much image-meta for one read")
    values, unreadable = metakeys.decode({k[len("metadata_"):]: v for k, v in meta.items()})
    return ImageState(pool=pool, name=name, size=int.from_bytes(fixed["size"], "little"),
                      features=feature_names(int.from_bytes(fixed["features"], "little")),
                      meta=values, unreadable=unreadable)


def _parse(pool: str, name: str, fixed_it: rados.OmapIterator,
           meta_it: rados.OmapIterator) -> ImageState:
    meta, bad = omap.entries(meta_it)
    return parse_header(pool, name, omap.entries(fixed_it)[0], meta, len(bad))


def header_state(cluster: rados.Rados, pool: str, name: str, image_id: str
                 ) -> ImageState | None:
    """ImageState without watchers (watchers empty); None: the image is gone."""
    try:
        with cluster.open_ioctx(pool) as ioctx, rados.ReadOpCtx() as op:
            fixed_it, _ = ioctx.get_omap_vals_by_keys(op, ("size", "features"))
            meta_it, _ = ioctx.get_omap_vals(op, "", "metadata_", MAX_META)
            ioctx.operate_read_op(op, f"rbd_header.{image_id}")
            return _parse(pool, name, fixed_it, meta_it)
    except rados.ObjectNotFound:
        return None  # removed since it was listed
    except rados.Error as exc:
        raise CephError(f"{pool}/{name}: {exc}") from exc


Answer = ImageState | None | Exception  # None: gone; Fallback: open it with librbd


def header_states(cluster: rados.Rados, pool: str, ids: dict[str, str],
                  deliver: Callable[[str, Answer], None]) -> None:
    """The headers of ``ids`` (name -> image id), one asynchronous read each,
    all issued at once; ``deliver(name, answer)`` as each answers, in any
    order. Returns once every read has answered: a read stuck on a PG that
    is down holds the call (and the ops it must not free) but not the other
    images' answers, so call it bounded and wait on what it delivers."""
    done: queue.SimpleQueue[str] = queue.SimpleQueue()
    pending: dict[str, tuple[rados.Completion, rados.OmapIterator, rados.OmapIterator]] = {}
    with cluster.open_ioctx(pool) as ioctx, contextlib.ExitStack() as ops:
        for name, image_id in ids.items():
            op = ops.enter_context(rados.ReadOpCtx())
            fixed_it, _ = ioctx.get_omap_vals_by_keys(op, ("size", "features"))
            meta_it, _ = ioctx.get_omap_vals(op, "", "metadata_", MAX_META)
            try:
                comp = ioctx.operate_aio_read_op(
                    op, f"rbd_header.{image_id}",
                    oncomplete=lambda _c, name=name: done.put(name))
            except rados.Error as exc:
                deliver(name, CephError(f"{pool}/{name}: {exc}"))
                continue
            pending[name] = (comp, fixed_it, meta_it)
        for _ in range(len(pending)):
            name = done.get()
            comp, fixed_it, meta_it = pending[name]
            deliver(name, _answer(pool, name, comp.get_return_value(), fixed_it, meta_it))


def _answer(pool: str, name: str, rc: int, fixed_it: rados.OmapIterator,
            meta_it: rados.OmapIterator) -> Answer:
    if rc == -errno.ENOENT:
        return None  # removed since it was listed
    if rc < 0:
        return CephError(f"{pool}/{name}: reading its header failed: {os.strerror(-rc)}")
    try:
        return _parse(pool, name, fixed_it, meta_it)
    except Fallback as exc:
        return exc
