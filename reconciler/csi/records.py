"""The controller's records in Ceph: name -> document, in the omap of one
RADOS object, every change a compare-and-set.

With ``csi.statePool`` set, what CreateVolume / CreateSnapshot / a group
snapshot made is kept where every controller replica sees it, not in one
node's csi.dir. A record is the controller's truth for its name:

- ``creating``: a replica claimed the name and its engine is making it;
  another replica asking is told to retry (ABORTED) until it is created, or
  until the claim is stale (that replica died) and is taken over.
- ``created``: made; the document is what the last acknowledged call left.
- ``deleting``: a tombstone. A delete writes it *before* its engine removes
  anything, and turns it into ``deleted`` once the image is gone; a racing
  call sees "being deleted", never "absent".
- ``deleted``: a delete that finished. Read as absent, but it is not absent:
  a call that read "absent" before the delete (a replica paused, its Ceph op
  held by a partition) and compares against that finds it changed, so a
  deleted name is never made again by a call that is over (no ABA). Swept
  after ``KEEP_DELETED_S``.

Who holds a name, and for how long, is judged on one clock only: the
reader's own monotonic clock, counting how long it has seen a claim, lease
or tombstone unchanged (``Records.age``). Two replicas' wall clocks are never
compared (a replica 10 minutes ahead neither takes over a live lease nor
waits out the skew to take over a dead one). A holder stops acting on what
it holds once ``FENCE_SHARE`` of the stale time has passed on its own clock
since it wrote it (``Records.expired``): before any other replica can have
seen it unchanged for the whole stale time.

Every record has a revision (``rev``), new with every write: a random token,
not a counter, so that a name deleted and made again never shows an old
revision (no ABA). A CSI file carries the revision it was built from
(``L_RECORD_REV``), and the engine acts on it only while the record still
has that revision (``Volumes.gate``): a file left behind by a call that was
cut off can never create, grow or delete anything after the record moved on.

Only the controller's part of a document is recorded (the image, QoS,
labels): stage and publish are one node's business.

Imported by csi/ (5 modules).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc
import rados

from reconciler.csi.cephinfo import CephInfo
from reconciler.csi.errors import CsiError
from reconciler.drivers import omap
from reconciler.spec.diagnostics import excerpt

log = logging.getLogger("rbd-reconciler.csi")

OBJECT = "rbd-reconciler.csi"
PREFIX = "v1."  # omap key: PREFIX + the file's name
PAGE = 1000
NODE_ONLY = ("map", "stage", "publish", "encryption")
STATES = ("creating", "created", "deleting", "deleted")
# A finished delete's marker is kept this long (by its writer's wall clock;
# a clock skewed by more only shortens the protection it gives a call paused
# for longer than that).
KEEP_DELETED_S = 86400.0
# A holder stops acting on its claim, lease or tombstone after this share of
# the stale time (its own monotonic clock): the rest is the margin for clocks
# that run at slightly different rates.
FENCE_SHARE = 0.8
SWEEP_EVERY_S = 3600.0  # old markers are looked for at most this often
SEEN_MAX = 10000  # names whose records this replica remembers seeing
KINDS = ("Volume", "Snapshot", "SnapshotGroup")


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
    state: str  # creating | created | deleting | deleted
    by: str  # the holder that wrote it (node@host:state dir)
    at: float  # its writer's wall clock: for people reading it, never compared
    rev: str  # new with every write
    raw: bytes  # as stored: the compare value of the next write
    # A change under way (expand, modify): the replica that leased the name
    # for it, and when. A tombstone is its writer's lease as well.
    op_by: str | None = None
    op_at: float = 0.0

    @property
    def live(self) -> bool:
        """Not a finished delete's marker: a name that stands or is changing."""
        return self.state != "deleted"


class Unreadable(CsiError):
    """A record that does not decode: an error for its name only."""


def _repair(pool: str, key: str) -> str:
    return (f"inspect it with `rados -p {pool} getomapval {OBJECT} {key}`, then remove it "
            f"with `rados -p {pool} rmomapkey {OBJECT} {key}`: the next call on the name "
            "rebuilds the record from its image if the image exists (its image-meta "
            "rbd-reconciler.csi-name), and finds the name free if it does not")


def decode(raw: bytes, pool: str, key: str) -> Record:
    """The record stored under ``key``; Unreadable (FAILED_PRECONDITION, with
    how to repair it) for anything this version did not write. Written by
    anyone with write access to the pool: checked field by field."""
    def bad(why: str) -> Unreadable:
        return Unreadable(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the controller record {key} in {pool}/{OBJECT} cannot be read "
                          f"({why}); nothing was changed: {_repair(pool, key)}")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"not JSON: {excerpt(str(exc))}") from None
    except RecursionError:
        raise bad("not JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise bad("not a JSON object")
    doc, state, by, at = data.get("doc"), data.get("state"), data.get("by"), data.get("at")
    if state not in STATES:
        raise bad(f"state {excerpt(state)}: expected one of {', '.join(STATES)}")
    if not isinstance(by, str) or isinstance(at, bool) or not isinstance(at, int | float):
        raise bad("'by' must be a string and 'at' a number")
    if not isinstance(doc, dict) or doc.get("kind", "Volume") not in KINDS or \
            not isinstance(doc.get("spec"), dict) or not isinstance(doc.get("metadata"), dict):
        raise bad("'doc' is not a Volume, Snapshot or SnapshotGroup document")
    labels = doc["metadata"].get("labels", {})
    if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise bad("metadata.labels must map strings to strings")
    kind = doc.get("kind", "Volume")
    spec = doc["spec"]
    if kind == "Volume" and not isinstance(spec.get("image"), dict):
        raise bad("a Volume document needs spec.image")
    if kind == "Snapshot" and not isinstance(spec.get("source"), dict):
        raise bad("a Snapshot document needs spec.source")
    if kind == "SnapshotGroup" and not isinstance(spec.get("images"), list):
        raise bad("a SnapshotGroup document needs spec.images")
    op = data.get("op")
    if op is not None and (not isinstance(op, dict) or not isinstance(op.get("by"), str)
                           or isinstance(op.get("at"), bool)
                           or not isinstance(op.get("at"), int | float)):
        raise bad("'op' must be {by: string, at: number}")
    rev = data.get("rev")
    if rev is None:  # written before revisions: its bytes stand for one
        rev = "legacy-" + hashlib.sha256(raw).hexdigest()[:16]
    elif not isinstance(rev, str):
        raise bad("'rev' must be a string")
    return Record(doc, state, by, float(at), rev, raw,
                  op["by"] if op else None, float(op["at"]) if op else 0.0)


class Records:
    def __init__(self, ceph: CephInfo, pool: str, holder: str, stale_s: float) -> None:
        self.ceph, self.pool, self.holder = ceph, pool, holder
        # A claim seen unchanged this long (this replica's own clock) is taken
        # over: its replica died, is paused, or lost its lead.
        self.stale_s = stale_s
        self._lock = threading.Lock()
        # name -> (the record's bytes, when this replica first saw them)
        self._seen: dict[str, tuple[bytes, float]] = {}
        # rev -> when this replica wrote it as a claim, lease or tombstone
        self._held: dict[str, float] = {}
        self._swept = time.monotonic()  # the start's sweep: the next in an hour

    def _encode(self, doc: dict[str, Any], state: str, lease: bool) -> tuple[bytes, str, float]:
        rev, now = secrets.token_hex(8), time.time()
        data: dict[str, Any] = {"doc": controller_view(doc), "state": state,
                                "by": self.holder, "at": now, "rev": rev}
        if lease:
            data["op"] = {"by": self.holder, "at": now}
        return json.dumps(data, sort_keys=True).encode(), rev, now

    def _write(self, key: str, value: bytes | None, expect: bytes) -> bool:
        """Set (or with ``value`` None remove) one key, only if it holds
        exactly ``expect`` now (b"": only if absent), in one RADOS op. False:
        someone else wrote first."""
        with self.ceph.client() as c, c.open_ioctx(self.pool) as io:
            with rados.WriteOpCtx() as op:  # a compare needs the object
                op.new(rados.LIBRADOS_CREATE_IDEMPOTENT)
                io.operate_write_op(op, OBJECT)
            with rados.WriteOpCtx() as op:
                # omap_cmp takes a str; our values are JSON (ASCII), a foreign
                # value that is not UTF-8 can only be replaced by hand.
                op.omap_cmp(key, expect.decode(errors="surrogateescape"),
                            rados.LIBRADOS_CMPXATTR_OP_EQ)
                if value is None:
                    io.remove_omap_keys(op, (key,))
                else:
                    io.set_omap(op, (key,), (value,))
                try:
                    io.operate_write_op(op, OBJECT)
                except rados.Error as exc:
                    if getattr(exc, "errno", None) == errno.ECANCELED:
                        return False  # the compare failed
                    raise
        return True

    def get(self, name: str) -> Record | None:
        """The record of ``name``; None when there is none. Unreadable when
        it does not decode (never read as absent)."""
        key = PREFIX + name
        with self.ceph.client() as c, c.open_ioctx(self.pool) as io, \
                rados.ReadOpCtx() as op:
            it, _ = io.get_omap_vals_by_keys(op, (key,))
            try:
                io.operate_read_op(op, OBJECT)
            except rados.ObjectNotFound:
                return None
            found = dict(it)
        raw = found.get(key)
        return decode(raw, self.pool, key) if raw is not None else None

    def all(self) -> dict[str, Record]:
        """Every readable record; one that does not decode is skipped (and
        logged): it concerns its own name, never the listing."""
        out: dict[str, Record] = {}
        with self.ceph.client() as c, c.open_ioctx(self.pool) as io:
            try:
                found, bad = omap.scan(io, OBJECT, PREFIX, PAGE)
            except rados.ObjectNotFound:
                return out
        for key in bad:  # no name of ours: it concerns no volume
            log.warning("a controller record key in %s/%s is not UTF-8 text (%r); skipped",
                        self.pool, OBJECT, key[:64])
        for key, raw in found.items():
            try:
                out[key[len(PREFIX):]] = decode(raw, self.pool, key)
            except Unreadable as exc:
                log.warning("%s", exc.message)
        return out

    def age(self, name: str, rec: Record) -> float:
        """How long this replica has seen ``rec`` unchanged, on its own
        monotonic clock (0 the first time): the writer's clock is never read."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(name)
            if seen is not None and seen[0] == rec.raw:
                return now - seen[1]
            if len(self._seen) >= SEEN_MAX:  # forget the oldest sightings
                for old in sorted(self._seen, key=lambda n: self._seen[n][1])[:SEEN_MAX // 10]:
                    del self._seen[old]
            self._seen[name] = (rec.raw, now)
            return 0.0

    def stale(self, name: str, rec: Record) -> bool:
        return rec.state == "creating" and self.age(name, rec) > self.stale_s

    def mine(self, name: str, rec: Record) -> bool:
        """A claim this replica may go on with: its own, or a dead one's."""
        return rec.state == "creating" and (rec.by == self.holder or self.stale(name, rec))

    def leased(self, name: str, rec: Record) -> str | None:
        """Who else is changing the name now (a live lease of another
        replica's, or its tombstone), or None: this replica may change it.
        A lease seen unchanged for ``stale_s`` was left by a replica that
        died or is paused (it stops acting on it before then: ``expired``)."""
        by = rec.by if rec.state == "deleting" else rec.op_by
        if by is None or by == self.holder or self.age(name, rec) > self.stale_s:
            return None
        return by

    def held(self, rec: Record) -> bool:
        """Whether ``rec`` is a claim, lease or tombstone in this replica's
        name (this process's, or a predecessor's on the same state dir)."""
        by = rec.op_by if rec.state == "created" else rec.by
        return rec.state != "deleted" and by == self.holder

    def expired(self, rev: str) -> bool:
        """Whether this replica may no longer act on its claim, lease or
        tombstone of revision ``rev``: FENCE_SHARE of the stale time has
        passed on its own clock since it sent the write, or this process
        never wrote it (a predecessor's, or forgotten): it cannot vouch for
        how old it is. Asked only of what ``held`` says is this replica's."""
        with self._lock:
            at = self._held.get(rev)
        return at is None or time.monotonic() - at > FENCE_SHARE * self.stale_s

    def write(self, name: str, expect: Record | None, doc: dict[str, Any],
              state: str, lease: bool = False) -> Record | None:
        """``doc`` in ``state`` under a new revision, only if the record is
        still ``expect`` (None: only if there is none); ``lease``: marked as
        being changed by this replica. None: it changed meanwhile."""
        value, rev, now = self._encode(doc, state, lease)
        # Counted from before the write is sent: other replicas count from
        # when it lands, which a held reply (or a pause) may long precede.
        sent = time.monotonic()
        if not self._write(PREFIX + name, value, expect.raw if expect else b""):
            return None
        if lease or state in ("creating", "deleting"):
            self._hold(rev, sent)
        return Record(controller_view(doc), state, self.holder, now, rev, value,
                      self.holder if lease else None, now if lease else 0.0)

    def _hold(self, rev: str, sent: float) -> None:
        now = time.monotonic()
        with self._lock:
            # Forgotten is expired (``expired``): only what is past it goes.
            for old in [r for r, at in self._held.items() if now - at > self.stale_s]:
                del self._held[old]
            self._held[rev] = sent

    def finish(self, name: str, tomb: Record) -> bool:
        """A delete done: the tombstone becomes a ``deleted`` marker, only if
        it is still ``tomb``."""
        return self.write(name, tomb, tomb.doc, "deleted") is not None

    def remove(self, name: str, expect: Record) -> bool:
        """Forget ``name`` only if its record is still ``expect``."""
        return self._write(PREFIX + name, None, expect.raw)

    def sweep_deleted(self, found: dict[str, Record] | None = None) -> int:
        """Remove the markers of deletes finished more than KEEP_DELETED_S
        ago (each by compare-and-set; ``found``: the records as just read);
        how many went. At most once an hour unless asked with nothing read."""
        if found is not None:
            with self._lock:
                if time.monotonic() - self._swept < SWEEP_EVERY_S:
                    return 0
                self._swept = time.monotonic()
        gone = 0
        for name, rec in (self.all() if found is None else found).items():
            if rec.state == "deleted" and time.time() - rec.at > KEEP_DELETED_S:
                gone += self.remove(name, rec)
        return gone
