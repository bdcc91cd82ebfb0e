"""Take, release and take over an image's claim; fence a node (blocklist).

The claim is the image-meta key ``meta.HOLDER``, i.e. the omap key
``metadata_<key>`` of the image's header object. librbd writes image-meta as
plain omap values, so the same value can be changed with one rados write op
that first compares it (``omap_cmp``): the OSD applies the compare and the
set as one transaction, so of two nodes claiming at once exactly one wins.
The claim outlives the process that took it (a CLI ``apply`` exits, the
rbd-fuse helper keeps the image mapped) and goes away with the image.

Imported by apply/mapsteps.py, apply/runner.py, apply/takeover.py; engine/.
"""

from __future__ import annotations

import json
import time

import rados
import rbd

from reconciler.drivers import omap
from reconciler.drivers.rbdbase import CephError, UnreadableMeta, header_oid, open_image
from reconciler.facts import meta
from reconciler.facts.claim import Claim, parse

KEY = "metadata_" + meta.HOLDER
MON_TIMEOUT_S = 15  # every mon command has a deadline
CAS_ATTEMPTS = 5


class ClaimedElsewhere(CephError):
    def __init__(self, pool: str, image: str, holder: Claim) -> None:
        super().__init__(f"{pool}/{image} is claimed by node {holder.node}"
                         + (f" (clients {', '.join(holder.clients)})" if holder.clients else ""))
        self.holder = holder


def header_object(ioctx: rados.Ioctx, image: str) -> str:
    if (oid := header_oid(ioctx, image)) is not None:
        return oid  # read from the id object: no image open
    try:
        with open_image(ioctx, image, read_only=True) as img:
            image_id = img.id()
            old_format = img.old_format()
    except rbd.ImageNotFound:
        raise CephError(f"image {image} does not exist") from None
    if old_format or not image_id:
        raise CephError(f"image {image} is RBD format 1: it cannot carry a claim; "
                        "convert it to format 2 (rbd migration) to use it here")
    return f"rbd_header.{image_id}"


def read_raw(ioctx: rados.Ioctx, oid: str) -> str | None:
    """The claim as stored; UnreadableMeta when it is not UTF-8 text: it is
    then nobody's to take, change or drop (it may be another node's)."""
    with rados.ReadOpCtx() as op:
        it, _ = ioctx.get_omap_vals_by_keys(op, (KEY,))
        ioctx.operate_read_op(op, oid)
        vals, _ = omap.entries(it)
    raw = vals.get(KEY)
    if raw is None:
        return None
    try:
        return meta.text(meta.HOLDER, raw)
    except meta.Unreadable as exc:
        raise UnreadableMeta(f"the claim cannot be read: {exc}; left as it is (see "
                             f"`rbd image-meta get IMAGE {meta.HOLDER}`)") from None


def _cas(ioctx: rados.Ioctx, oid: str, old: str | None, new: str | None) -> bool:
    """Set (or remove, ``new`` None) the claim if it is still ``old`` (None:
    absent; a missing key compares equal to the empty value). False: it changed."""
    with rados.WriteOpCtx() as op:
        op.omap_cmp(KEY, old or "", rados.LIBRADOS_CMPXATTR_OP_EQ)
        if new is None:
            ioctx.remove_omap_keys(op, (KEY,))
        else:
            ioctx.set_omap(op, (KEY,), (new.encode(),))
        try:
            ioctx.operate_write_op(op, oid)
        except rados.ObjectNotFound:
            raise CephError("the image is gone") from None
        except rados.Error:
            if read_raw(ioctx, oid) != old:
                return False  # someone else changed it first
            raise
    return True


def watchers(ioctx: rados.Ioctx, image: str) -> tuple[str, ...]:
    with open_image(ioctx, image, read_only=True) as img:
        return tuple(sorted(w["addr"] for w in img.watchers_list()))


def current(cluster: rados.Rados, pool: str, image: str) -> Claim | None:
    with cluster.open_ioctx(pool) as ioctx:
        return parse(read_raw(ioctx, header_object(ioctx, image)))


def take(cluster: rados.Rados, pool: str, image: str, node: str) -> tuple[Claim, bool]:
    """Claim the image for ``node``; a claim already naming ``node`` is ours
    (any process of this node took it). ClaimedElsewhere: another node has it.
    Returns the claim and whether this call took it (False: held already)."""
    with cluster.open_ioctx(pool) as ioctx:
        oid = header_object(ioctx, image)
        for _ in range(CAS_ATTEMPTS):
            raw = read_raw(ioctx, oid)
            held = parse(raw)
            if held is not None and held.node != node:
                raise ClaimedElsewhere(pool, image, held)
            if held is not None:
                return held, False
            mine = Claim(node)
            if _cas(ioctx, oid, None, mine.encode()):
                return mine, True
    raise CephError(f"{pool}/{image}: the claim kept changing; try again")


def record_clients(cluster: rados.Rados, pool: str, image: str, node: str,
                   clients: tuple[str, ...]) -> Claim:
    """Write the mapping clients into our claim; ClaimedElsewhere if it is not ours."""
    with cluster.open_ioctx(pool) as ioctx:
        oid = header_object(ioctx, image)
        for _ in range(CAS_ATTEMPTS):
            raw = read_raw(ioctx, oid)
            held = parse(raw)
            if held is None or held.node != node:
                raise ClaimedElsewhere(pool, image, held or Claim("(nobody)"))
            mine = Claim(node, clients, held.taken_from, held.fenced)
            if mine == held or _cas(ioctx, oid, raw, mine.encode()):
                return mine
    raise CephError(f"{pool}/{image}: the claim kept changing; try again")


def release(cluster: rados.Rados, pool: str, image: str, node: str) -> bool:
    """Drop ``node``'s claim; False when it held none (never drops another's,
    nor one that cannot be read)."""
    with cluster.open_ioctx(pool) as ioctx:
        try:
            oid = header_object(ioctx, image)
        except CephError:
            return False  # the image is gone, and its claim with it
        for _ in range(CAS_ATTEMPTS):
            try:
                raw = read_raw(ioctx, oid)
            except UnreadableMeta:
                return False
            held = parse(raw)
            if held is None or held.node != node:
                return False
            if _cas(ioctx, oid, raw, None):
                return True
    raise CephError(f"{pool}/{image}: the claim kept changing; try again")


def add_fenced(cluster: rados.Rados, pool: str, image: str, node: str,
               addrs: tuple[str, ...]) -> Claim | None:
    """Add ``addrs`` to the ``fenced`` list of ``node``'s claim (what explain
    shows); None when the claim is not ``node``'s any more."""
    with cluster.open_ioctx(pool) as ioctx:
        oid = header_object(ioctx, image)
        for _ in range(CAS_ATTEMPTS):
            raw = read_raw(ioctx, oid)
            held = parse(raw)
            if held is None or held.node != node:
                return None
            fenced = tuple(dict.fromkeys((*held.fenced, *addrs)))
            mine = Claim(node, held.clients, held.taken_from, fenced)
            if mine == held or _cas(ioctx, oid, raw, mine.encode()):
                return mine
    raise CephError(f"{pool}/{image}: the claim kept changing; try again")


def replace(cluster: rados.Rados, pool: str, image: str, expected: Claim,
            new: Claim) -> bool:
    """The takeover's last step: ``new`` if the claim is still ``expected``."""
    with cluster.open_ioctx(pool) as ioctx:
        oid = header_object(ioctx, image)
        raw = read_raw(ioctx, oid)
        if parse(raw) != expected:
            return False
        return _cas(ioctx, oid, raw, new.encode())


# -- fencing -------------------------------------------------------------------
def _mon(cluster: rados.Rados, cmd: dict[str, object]) -> tuple[bytes, str]:
    rc, out, err = cluster.mon_command(json.dumps(cmd), b"", timeout=MON_TIMEOUT_S)
    if rc != 0:
        raise CephError(f"ceph {cmd['prefix']}: {err or rc}")
    return out, err


# How long a fenced client stays fenced. Ceph's default (1 h) would let a
# node that was only cut off, and comes back later with its mapping still
# up, write again. The entry names one client instance (its nonce), which no
# later client reuses, so a long expiry costs nothing but an osdmap entry.
FENCE_SECONDS = 30 * 24 * 3600


def blocklist_add(cluster: rados.Rados, addr: str) -> str:
    """Blocklist one client instance (ip:port/nonce, never a bare ip: other
    clients on that host must keep working) for FENCE_SECONDS."""
    if "/" not in addr:
        raise CephError(f"refusing to blocklist {addr!r}: not one client's address")
    return _mon(cluster, {"prefix": "osd blocklist", "blocklistop": "add", "addr": addr,
                          "expire": float(FENCE_SECONDS)})[1]


def blocklist(cluster: rados.Rados) -> dict[str, str]:
    """addr -> until, of every blocklisted client."""
    out, _ = _mon(cluster, {"prefix": "osd blocklist ls", "format": "json"})
    # 16.2 prints two JSON lists back to back (addresses, then ranges).
    entries, _ = json.JSONDecoder().raw_decode(out.decode() or "[]")
    return {e["addr"]: e.get("until", "") for e in entries if isinstance(e, dict)}


def wait_watchers_gone(cluster: rados.Rados, pool: str, image: str,
                       addrs: set[str], timeout: float = 30.0) -> tuple[str, ...]:
    """The OSD drops a blocklisted client's watch when it sees the new map.
    Returns the watchers still there from ``addrs`` (empty: gone)."""
    deadline = time.monotonic() + timeout
    with cluster.open_ioctx(pool) as ioctx:
        while True:
            left = tuple(a for a in watchers(ioctx, image) if a in addrs)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)
