"""The few things the adapter asks Ceph itself: is it there (Probe), how much
room is left (GetCapacity), does an image exist and how big is it (ids a node
did not create), and the CSI request name recorded in image-meta. Storage work
(create, map, mount, delete) is always the engine's."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import rados
import rbd

from reconciler.drivers.ceph import CephError, connect, get_meta, set_meta, snapshot_children
from reconciler.facts import meta
from reconciler.spec.config import CephConfig

CSI_NAME_META = "rbd-reconciler.csi-name"
PROBE_CACHE_S = 5.0
TIMEOUT_S = 10


class CephInfo:
    def __init__(self, cfg: CephConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._probe: tuple[float, str | None] | None = None  # (when, error)

    def _client(self) -> contextlib.AbstractContextManager[rados.Rados]:
        return connect(self.cfg, timeout=TIMEOUT_S)

    def problem(self) -> str | None:
        """None when Ceph answers; else why not. Cached for a few seconds."""
        with self._lock:
            if self._probe and time.monotonic() - self._probe[0] < PROBE_CACHE_S:
                return self._probe[1]
            try:
                with self._client() as c:
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

    def record_name(self, pool: str, image: str, request_name: str) -> None:
        with self._client() as c:
            set_meta(c, pool, image, CSI_NAME_META, request_name)

    def available(self, pool: str | None) -> int:
        """Bytes that can still be written to ``pool`` (or to the cluster).

        Ceph's usage figures come from its manager: a cluster without one
        (our test cluster) reports 0, which is what we pass on."""
        with self._client() as c:
            if pool is not None and not c.pool_exists(pool):
                raise CephError(f"pool {pool!r} does not exist")
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
