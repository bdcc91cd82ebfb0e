"""The few things the adapter asks Ceph itself: is it there (Probe), how much
room is left (GetCapacity), does an image exist and how big is it (ids a node
did not create), and the CSI request name recorded in image-meta. Storage work
(create, map, mount, delete) is always the engine's.

Imported by csi/ (8 modules).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import rados
import rbd

from reconciler.csi.errors import quoted
from reconciler.drivers.ceph import connect, get_meta, set_meta
from reconciler.drivers.groups import snapshot_members
from reconciler.drivers.rbdbase import CephError, snapshot_children
from reconciler.facts import meta
from reconciler.spec.config import CephConfig

CSI_NAME_META = "rbd-reconciler.csi-name"
CSI_LABELS_META = meta.CSI_LABELS
PROBE_CACHE_S = 5.0
TIMEOUT_S = 10


# Answers that say nothing about the connection: it is kept.
_NOT_FOUND = (rados.ObjectNotFound, rbd.ImageNotFound)


class _Conn:
    """One librados connection shared by concurrent requests; shut down by
    its last user once it is retired (a call on it failed)."""

    def __init__(self, stack: contextlib.ExitStack, cluster: rados.Rados) -> None:
        self.stack, self.cluster = stack, cluster
        self.users = 1  # the CephInfo that keeps it
        self.lock = threading.Lock()

    def hold(self) -> None:
        with self.lock:
            self.users += 1

    def drop(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.stack.close()


class CephInfo:
    """Keeps one librados connection across requests (a connect costs ~15 ms,
    more than the call it serves): replaced after a call on it fails for any
    reason but "not found", and after MAX_AGE. ``problem()`` (Probe) still
    connects afresh, at most every PROBE_CACHE_S: it is the check that Ceph
    answers now, which a kept connection does not prove."""

    MAX_AGE = 600.0

    def __init__(self, cfg: CephConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._probe: tuple[float, str | None] | None = None  # (when, error)
        self._conn_lock = threading.Lock()
        self._conn: _Conn | None = None
        self._since = 0.0
        self.connects = 0  # connections made for requests (tests count them)

    @contextlib.contextmanager
    def _client(self) -> Iterator[rados.Rados]:
        with self._conn_lock:
            conn = self._conn
            if conn is not None and time.monotonic() - self._since > self.MAX_AGE:
                self._conn = None
                conn.drop()
                conn = None
            if conn is None:
                stack = contextlib.ExitStack()
                cluster = stack.enter_context(connect(self.cfg, timeout=TIMEOUT_S))
                conn = self._conn = _Conn(stack, cluster)
                self._since = time.monotonic()
                self.connects += 1
            conn.hold()
        try:
            yield conn.cluster
        except _NOT_FOUND:
            raise
        except BaseException:
            self._retire(conn)  # timed out, shut down, refused...: never reused
            raise
        finally:
            conn.drop()

    def client(self) -> contextlib.AbstractContextManager[rados.Rados]:
        """The shared connection, for the controller's records (csi/records.py)."""
        return self._client()

    def _retire(self, conn: _Conn) -> None:
        with self._conn_lock:
            if self._conn is not conn:
                return
            self._conn = None
        conn.drop()

    def close(self) -> None:
        with self._conn_lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.drop()

    def problem(self) -> str | None:
        """None when Ceph answers; else why not. Cached for a few seconds."""
        with self._lock:
            if self._probe and time.monotonic() - self._probe[0] < PROBE_CACHE_S:
                return self._probe[1]
            try:
                with connect(self.cfg, timeout=TIMEOUT_S) as c:
                    c.get_fsid()
                    error = None
            except (CephError, rados.Error) as exc:
                error = str(exc)
            self._probe = (time.monotonic(), error)
            return error

    def image_size(self, pool: str, image: str) -> int | None:
        """The image's size, or None when it (or its pool) does not exist."""
        try:
            with self._client() as c, c.open_ioctx(pool) as io, \
                    rbd.Image(io, image, read_only=True) as img:
                return int(img.size())
        except (rados.ObjectNotFound, rbd.ImageNotFound):
            return None

    def snapshot(self, pool: str, image: str, snap: str) -> tuple[int, float] | None:
        """(size, creation time) of a snapshot; None when it does not exist."""
        try:
            with self._client() as c, c.open_ioctx(pool) as io, \
                    rbd.Image(io, image, read_only=True) as img:
                for s in img.list_snaps():
                    if s["name"] == snap:
                        return int(s["size"]), img.get_snap_timestamp(s["id"]).timestamp()
        except (rados.ObjectNotFound, rbd.ImageNotFound):
            return None
        return None

    def group_snapshot(self, pool: str, group: str) -> dict[str, tuple[int, float]] | None:
        """Member image -> (size, creation time) of the group snapshot named
        like its group; None when it does not exist (or is not complete)."""
        with self._client() as c:
            return snapshot_members(c, pool, group, group)

    def image_group(self, pool: str, image: str) -> str | None:
        """The RBD group the image belongs to ("pool/group"), or None."""
        try:
            with self._client() as c, c.open_ioctx(pool) as io, \
                    rbd.Image(io, image, read_only=True) as img:
                info = img.group()
                if not info.get("name"):
                    return None
                try:
                    where = c.pool_reverse_lookup(int(info["pool"]))
                except (rados.Error, ValueError, TypeError):
                    where = str(info.get("pool"))
                return f"{where}/{info['name']}"
        except (rados.ObjectNotFound, rbd.ImageNotFound):
            return None

    def watchers(self, pool: str, image: str) -> list[str]:
        """Addresses of the clients that have the image open (none when it,
        or its pool, does not exist). A Ceph that does not answer raises."""
        try:
            with self._client() as c, c.open_ioctx(pool) as io, \
                    rbd.Image(io, image, read_only=True) as img:
                return sorted(w["addr"] for w in img.watchers_list())
        except (rados.ObjectNotFound, rbd.ImageNotFound):
            return []

    def snapshot_children(self, pool: str, image: str, snap: str) -> list[str]:
        """``pool/image`` of the clones of a snapshot (none when it is gone)."""
        try:
            with self._client() as c:
                return snapshot_children(c, pool, image, snap)
        except (rados.ObjectNotFound, rbd.ImageNotFound):
            return []

    def record_name(self, pool: str, image: str, request_name: str,
                    labels: str | None = None) -> None:
        """The CSI request name (and ``labels``, what a node needs to stage
        it) in the image's meta: a record removed by hand is rebuilt from it."""
        with self._client() as c:
            set_meta(c, pool, image, CSI_NAME_META, request_name)
            if labels is not None:
                set_meta(c, pool, image, CSI_LABELS_META, labels)

    def image_with_meta(self, pool: str, image: str) -> tuple[int, dict[str, str]] | None:
        """The image's size and image-meta; None when it does not exist."""
        try:
            with self._client() as c:
                with c.open_ioctx(pool) as io, rbd.Image(io, image, read_only=True) as img:
                    size = int(img.size())
                return size, get_meta(c, pool, image)
        except (rados.ObjectNotFound, rbd.ImageNotFound):
            return None

    def available(self, pool: str | None) -> int:
        """Bytes that can still be written to ``pool`` (or to the cluster).

        Ceph's usage figures come from its manager: a cluster without one
        (our test cluster) reports 0, which is what we pass on."""
        with self._client() as c:
            if pool is not None and not c.pool_exists(pool):
                raise CephError(f"pool {quoted(pool)} does not exist")
            cmd = json.dumps({"prefix": "df", "format": "json"})
            ret, out, err = c.mon_command(cmd, b"", timeout=TIMEOUT_S)
            if ret != 0:
                raise CephError(f"ceph df: {err or ret}")
            df = json.loads(out)
            for p in df.get("pools", []):
                if p.get("name") == pool:
                    return int(p["stats"]["max_avail"])
            return int(df.get("stats", {}).get("total_avail_bytes", 0))

    def encrypted(self, pool: str, image: str) -> bool:
        """Whether the image holds a LUKS2 container we formatted (image-meta)."""
        with self._client() as c:
            try:
                return bool(get_meta(c, pool, image).get(meta.CRYPT_FORMATTED))
            except (CephError, rados.Error, rbd.ImageNotFound):
                return False
