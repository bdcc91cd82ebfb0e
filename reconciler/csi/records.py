"""The controller's records in Ceph: name -> document, in the omap of one
RADOS object, written with compare-and-set.

With ``csi.statePool`` set, what CreateVolume / CreateSnapshot made is kept
where every controller replica sees it, not only in one node's csi.dir: a
replica on another node (or a restarted one with an empty csi.dir) rebuilds
its local file from the record before it expands, modifies or deletes. The
first replica to claim a name creates it; another one asking for the same
name meanwhile is told to retry (ABORTED), so an image is never created by
two engines at once. Only the controller's part of a document is recorded
(the image, QoS, labels): stage and publish are one node's business.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from typing import Any

import grpc
import rados

from reconciler.csi.cephinfo import CephInfo
from reconciler.csi.errors import CsiError

OBJECT = "rbd-reconciler.csi"
PREFIX = "v1."  # omap key: PREFIX + the file's name
PAGE = 1000
NODE_ONLY = ("map", "stage", "publish", "encryption")


def controller_view(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without what one node added (map, stage, publish, and the
    encryption section a stage puts in from the label)."""
    out = copy.deepcopy(doc)
    for key in NODE_ONLY:
        out["spec"].pop(key, None)
    return out


@dataclass(frozen=True)
class Record:
    doc: dict[str, Any]
    state: str  # creating | created
    by: str  # the holder that wrote it (host:pid)
    at: float
    raw: bytes  # as stored: the compare value of a take-over


def _decode(raw: bytes) -> Record | None:
    try:
        data = json.loads(raw)
        return Record(data["doc"], data["state"], data["by"], float(data["at"]), raw)
    except (ValueError, KeyError, TypeError):
        return None  # written by hand or by a newer version: not ours to read


class Records:
    def __init__(self, ceph: CephInfo, pool: str, holder: str, stale_s: float) -> None:
        self.ceph, self.pool, self.holder = ceph, pool, holder
        # A claim this old whose creator never finished is taken over: that
        # replica died or lost its lead (its own calls end well before).
        self.stale_s = stale_s

    def _encode(self, doc: dict[str, Any], state: str) -> bytes:
        return json.dumps({"doc": controller_view(doc), "state": state, "by": self.holder,
                           "at": time.time()}, sort_keys=True).encode()

    def _write(self, key: str, value: bytes | None, expect: bytes | None) -> bool:
        """Set (or with ``value`` None remove) one key; with ``expect``, only if
        the key holds exactly that now (b"": only if absent). False: it did not."""
        with self.ceph.client() as c, c.open_ioctx(self.pool) as io:
            if expect is not None:  # a compare needs the object (set_omap makes it)
                with rados.WriteOpCtx() as op:
                    op.new(rados.LIBRADOS_CREATE_IDEMPOTENT)
                    io.operate_write_op(op, OBJECT)
            with rados.WriteOpCtx() as op:
                if expect is not None:
                    op.omap_cmp(key, expect.decode(), rados.LIBRADOS_CMPXATTR_OP_EQ)
                if value is None:
                    io.remove_omap_keys(op, (key,))
                else:
                    io.set_omap(op, (key,), (value,))
                try:
                    io.operate_write_op(op, OBJECT)
                except rados.Error:
                    if expect is None:
                        raise
                    return False  # the compare failed: someone else wrote first
        return True

    def get(self, name: str) -> Record | None:
        with self.ceph.client() as c, c.open_ioctx(self.pool) as io, \
                rados.ReadOpCtx() as op:
            it, _ = io.get_omap_vals_by_keys(op, (PREFIX + name,))
            try:
                io.operate_read_op(op, OBJECT)
            except rados.ObjectNotFound:
                return None
            found = dict(it)
        raw = found.get(PREFIX + name)
        return _decode(raw) if raw is not None else None

    def all(self) -> dict[str, Record]:
        out: dict[str, Record] = {}
        after = ""
        with self.ceph.client() as c, c.open_ioctx(self.pool) as io:
            while True:
                with rados.ReadOpCtx() as op:
                    it, _ = io.get_omap_vals(op, after, PREFIX, PAGE)
                    try:
                        io.operate_read_op(op, OBJECT)
                    except rados.ObjectNotFound:
                        return out
                    page = list(it)
                for key, raw in page:
                    rec = _decode(raw)
                    if rec is not None:
                        out[key[len(PREFIX):]] = rec
                if len(page) < PAGE:
                    return out
                after = page[-1][0]

    def claim(self, name: str, doc: dict[str, Any]) -> Record | None:
        """Take ``name`` for a create: None when it is ours now (no record
        yet, our own earlier claim, or a dead replica's stale one); else the
        record that stands (another replica's, or one already created)."""
        key = PREFIX + name
        for _ in range(3):
            have = self.get(name)
            if have is None:
                if self._write(key, self._encode(doc, "creating"), b""):
                    return None
                continue  # someone claimed it between the read and the write
            stale = self.stale(have)
            if not (have.by == self.holder and have.state == "creating") and not stale:
                return have
            if self._write(key, self._encode(doc, "creating"), have.raw):
                return None
        raise CsiError(grpc.StatusCode.ABORTED, f"the record of {name} in {self.pool}/{OBJECT} "
                       "kept changing; retry")

    def stale(self, rec: Record) -> bool:
        return rec.state == "creating" and time.time() - rec.at > self.stale_s

    def put(self, name: str, doc: dict[str, Any]) -> None:
        """The document as it now stands (created, expanded, modified)."""
        self._write(PREFIX + name, self._encode(doc, "created"), None)

    def forget(self, name: str) -> None:
        self._write(PREFIX + name, None, None)
