"""Turning a CSI call into a desired-volume file and waiting for the engine.

Each call edits one file: validate the new content exactly as the daemon will
load it, rename it into place, wake the daemon for that volume, and wait
until its status covers what was written (observedGeneration = the spec
hash). One call per volume at a time: a second one is ABORTED.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from reconciler.csi import ids
from reconciler.csi.calls import Calls
from reconciler.csi.errors import CsiError, invalid, precondition, quoted
from reconciler.csi.files import (
    L_ACCESS,
    L_ENCRYPTION,
    L_FSTYPE,
    L_MAPPER,
    L_RECORD_REV,
    VolumeFiles,
)
from reconciler.csi.records import NODE_ONLY, Record, Records, Unreadable
from reconciler.plan.steps import CreateSnapshot, DeleteSnapshot, Step
from reconciler.spec.config import Config
from reconciler.spec.desired import claims, operator_conflicts
from reconciler.spec.loader import load
from reconciler.spec.model import Volume

if TYPE_CHECKING:
    from reconciler.engine import Served

log = logging.getLogger("rbd-reconciler.csi")
DEADLINE_MARGIN_S = 0.25  # answer before the caller's deadline cuts us off
# The step the start-up sweep asks the gate about: none in particular.
SWEEP = Step("")
# What a node takes from the controller's record for a volume staged by id.
NODE_LABELS = (L_MAPPER, L_FSTYPE, L_ACCESS, L_ENCRYPTION)
# Reads and compare-and-sets of one call before it answers ABORTED (another
# replica changed the record every time).
ATTEMPTS = 4


def rev_of(doc: dict[str, Any]) -> str | None:
    """The record revision a CSI file was built from (None: not from one)."""
    labels = doc.get("metadata", {}).get("labels") or {}
    rev = labels.get(L_RECORD_REV) if isinstance(labels, dict) else None
    return rev if isinstance(rev, str) and rev else None


def with_rev(doc: dict[str, Any], rev: str) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["metadata"].setdefault("labels", {})[L_RECORD_REV] = rev
    return out


def merge(rec: Record, file: dict[str, Any] | None) -> dict[str, Any]:
    """The record's document with what this node added to its file."""
    merged = copy.deepcopy(rec.doc)
    for key in NODE_ONLY:
        if file is not None and key in file["spec"]:
            merged["spec"][key] = file["spec"][key]
    return merged


def node_view(doc: dict[str, Any]) -> dict[str, Any]:
    """A file that keeps only this node's part: the image by name (no size,
    features, source or QoS to enforce), the map, stage, publish and
    encryption it added, and no record revision."""
    out = copy.deepcopy(doc)
    labels = out["metadata"].get("labels") or {}
    labels.pop(L_RECORD_REV, None)
    img = out["spec"].get("image") or {}
    out["spec"] = {"state": "present",
                   "image": {"pool": img.get("pool"), "name": img.get("name")},
                   **{k: v for k, v in out["spec"].items() if k in NODE_ONLY}}
    return out


def _controller_part(doc: dict[str, Any]) -> bool:
    """Whether a file says more of its image than which one it is (a size:
    the controller's part, which creates and grows it)."""
    img = doc.get("spec", {}).get("image")
    return isinstance(img, dict) and "size" in img


def absent_form(doc: dict[str, Any]) -> None:
    """The ``state: absent`` form of any kind of document (a volume's image
    deleted with it: only the controller's volumes are ever tombstoned)."""
    doc["spec"]["state"] = "absent"
    if isinstance(doc["spec"].get("image"), dict):
        doc["spec"]["image"]["reclaimPolicy"] = "Delete"


def _contended(name: str) -> CsiError:
    return CsiError(grpc.StatusCode.ABORTED,
                    f"the controller record of {name} kept changing under this call (other "
                    "replicas are changing it); nothing is lost: retry")


class Volumes:
    def __init__(self, engine: Served) -> None:
        self.engine = engine
        self.files = VolumeFiles(engine.config.csi_dir)
        self._guard = threading.Lock()
        self._freed = threading.Condition(self._guard)  # a name's call ended
        self._busy: set[str] = set()
        self.calls = Calls()
        self.records: Records | None = None  # csi.statePool: the server sets it

    # -- the controller's records in Ceph (csi.statePool) ------------------------
    def read(self, name: str, made: bool = False) -> dict[str, Any] | None:
        """The controller's view of ``name`` (None: it does not exist, or is
        being deleted). With records in Ceph the record is the truth for the
        controller's part (another replica may have grown, modified or
        deleted it since), with what this node added (stage, publish) from
        its file. Nothing is written. A record that does not decode is an
        error for this name (never "absent"). ``made``: only what a create
        finished (ListVolumes, ValidateVolumeCapabilities): a claim is not a
        volume yet, and a dead one's image may never have been made."""
        doc = self.files.read(name)
        if self.records is None:
            return doc
        rec = self.records.get(name)
        if made and rec is not None and rec.state == "creating":
            return None
        return self._view(name, rec, doc)

    def _view(self, name: str, rec: Record | None, doc: dict[str, Any] | None
              ) -> dict[str, Any] | None:
        assert self.records is not None
        if rec is None:
            # Never recorded (made before statePool, or staged by id on this
            # node) stands; a file built from a record that is gone is stale.
            return None if doc is None or rev_of(doc) else doc
        if not rec.live:
            return None  # deleted through the records (by any replica): gone
        if rec.state == "deleting":
            return None
        if rec.state == "creating" and not self.records.mine(name, rec):
            raise CsiError(grpc.StatusCode.ABORTED,
                           f"{name} is being created by controller {rec.by}; retry")
        return merge(rec, doc)

    def let_go(self, name: str, doc: dict[str, Any]) -> None:
        """With records in Ceph, a converged file keeps no controller part: a
        controller-only file is removed (the daemon forgets it: nothing is
        mapped), one with a stage, publish or map keeps that part only. A
        controller part left behind would be converged again after another
        replica changed or deleted the volume."""
        if self.records is None:
            return
        if not any(k in doc["spec"] for k in NODE_ONLY):
            self.files.remove(name)
            return
        node = node_view(doc)
        if self.files.read(name) != node:
            self.files.commit(name, self.files.write_temp(name, node))
            self.engine.wake_volume(name)

    def node_file(self, name: str) -> dict[str, Any] | None:
        """The file a node call (stage, publish and their reverse) edits: with
        records in Ceph, never a controller part (a leftover one would act
        on an old revision): only this node's."""
        doc = self.files.read(name)
        if self.records is None or doc is None or not rev_of(doc):
            return doc
        return node_view(doc)

    def recorded_labels(self, name: str) -> dict[str, str]:
        """The labels a node needs (mapper, fs type, access type, encryption)
        from the controller's record, for a volume staged by its id alone."""
        if self.records is None:
            return {}
        try:
            rec = self.records.get(name)
        except Unreadable:
            raise
        except Exception as exc:  # unknown is not "none": an encrypted one must not lose it
            raise CsiError(grpc.StatusCode.UNAVAILABLE,
                           f"volume {name}: cannot read its controller record ({exc}); nothing "
                           "was changed, retry later") from None
        if rec is None or rec.state != "created":
            return {}
        labels = rec.doc["metadata"].get("labels") or {}
        return {k: v for k, v in labels.items() if k in NODE_LABELS}

    def settle_here(self, name: str, deadline: float, rec: Record | None = None) -> None:
        """settle() when this replica has the file (a call of its own still
        converging); with records, only a file of the record's revision (an
        earlier call's work that goes on); one of another revision is dropped
        (the gate would refuse it), and with no file there is nothing to wait for."""
        if self.records is None:
            self.settle(name, deadline)
            return
        try:
            doc = self.files.read(name)
        except CsiError:
            return  # broken by hand: the daemon freezes it; the record answers
        if doc is None:
            return
        rev = rev_of(doc)
        if rev is not None and (rec is None or rev != rec.rev):
            self._drop(name)
        elif rev is not None or rec is None:
            self.settle(name, deadline)

    def names(self) -> list[str]:
        """Every name the controller answers for: its files, and with records
        in Ceph every created one (rebuilt here when it is read)."""
        names = set(self.files.names())
        if self.records is not None:
            # Being created too: a delete of its source must see it coming.
            found = self.records.all()
            names.update(n for n, r in found.items() if r.state in ("creating", "created"))
            with contextlib.suppress(Exception):  # a later listing sweeps them
                self.records.sweep_deleted(found)
        return sorted(names)

    def _record(self, name: str) -> Record | None:
        assert self.records is not None
        return self.records.get(name)

    def _moved(self, name: str, rec: Record) -> bool:
        """The record is no longer the one a file was built from."""
        now = self._record(name)
        return now is None or now.rev != rec.rev

    def _converge_at(self, name: str, doc: dict[str, Any], rec: Record, deadline: float,
                     finish: tuple[Callable[[], bool], Callable[[], object] | None]) -> bool:
        """Converge ``doc`` as a file of revision ``rec`` (the engine acts on
        it only while the record stands). False: the record moved on meanwhile
        (the engine stopped, or this call's change may be missing from it):
        the caller reads it again and decides again. Past the caller's
        deadline the work goes on, and so does the call's record: ``finish``
        (record it done; let the record go back) runs once it converged."""
        try:
            self.converge(name, with_rev(doc, rec.rev), deadline)
        except CsiError as exc:
            if exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL) \
                    and self._moved(name, rec):
                return False
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                threading.Thread(target=self._finish_later, args=(name, rec, doc, *finish),
                                 name=f"csi-finish-{name[:20]}", daemon=True).start()
            raise
        return True

    def _finish_later(self, name: str, rec: Record, doc: dict[str, Any],
                      done: Callable[[], bool], undone: Callable[[], object] | None) -> None:
        """A call cut off by its deadline: its file goes on converging; once
        it has, its record change is made as the call would have made it (so
        the name is free for other replicas at once, not after its lease goes
        stale). A retry of the call that comes first does it instead."""
        assert self.records is not None
        stale_s = self.records.stale_s
        try:
            # The cut-off call holds the name until it has answered; a retry
            # of it may come meanwhile and take over (its own revision): this
            # then does nothing (every write compares the revision).
            with self.operation(name, wait_s=stale_s):
                if rev_of(self.files.read(name) or {}) != rec.rev:
                    return
            failed = None
            try:
                self.settle(name, time.monotonic() + stale_s)
            except CsiError as exc:
                failed = exc
            with self.operation(name, wait_s=stale_s):
                if rev_of(self.files.read(name) or {}) != rec.rev:
                    return
                if failed is not None:
                    if failed.code in (grpc.StatusCode.FAILED_PRECONDITION,
                                       grpc.StatusCode.INTERNAL) and undone is not None:
                        undone()  # refused or failed: the record as it was
                        self._drop(name)  # and its file acts no more
                    log.info("%s: a cut-off call did not converge: %s", name, failed.message)
                    return
                if done():
                    if doc["spec"].get("state") == "absent":
                        self.files.remove(name)
                    else:
                        self.let_go(name, doc)
        except Exception as exc:  # a retry of the call finishes what this could not
            log.info("%s: finishing a cut-off call: %s", name, exc)

    def create(self, name: str, doc: dict[str, Any], deadline: float,
               same: Callable[[dict[str, Any]], None],
               gone: Callable[[], bool] | None = None) -> dict[str, Any]:
        """CreateVolume, CreateSnapshot, CreateVolumeGroupSnapshot: make
        ``doc``, or answer with the one that stands (``same`` raises
        ALREADY_EXISTS when it is not what was asked). With records: claim
        the name (compare-and-set), converge, record it created (compare-
        and-set); a replica that loses a race re-reads or answers ABORTED.
        ``gone``: whether what a tombstone of the name deleted is gone from
        Ceph (the delete then is finished, and the name free again)."""
        if self.records is None:
            have = self.files.read(name)
            if have is not None and have["spec"].get("state", "present") == "present":
                same(have)
                self.settle(name, deadline)
                return have
            self.calls.in_time(name, "its file")
            self.converge(name, doc, deadline)
            return doc
        for _ in range(ATTEMPTS):
            rec = self._record(name)
            if rec is not None and rec.state == "created":
                file = self.files.read(name)
                # The record's document: what is done (a cut-off call's
                # larger size is not acknowledged until it has converged).
                have = merge(rec, file)
                same(have)
                if self._in_flight(rec, file) is None:
                    self.settle_here(name, deadline, rec)
                    self.let_go(name, have)
                # else a cut-off call of ours goes on under its lease: its
                # finish records it and lets the file go (letting it go here
                # would leave the record at the document from before it).
                return have
            if rec is not None and rec.state == "deleting":
                self._refuse_leased(name, rec)
                # Its replica died, or is paused past the stale time (it acts
                # on it no more): the delete is finished here first.
                if gone is not None and gone():
                    self.calls.in_time(name, "the end of a dead delete")
                    self.records.finish(name, rec)
                else:
                    self._finish_tombstone(name, rec, deadline)
                continue
            if rec is not None and rec.live and not self.records.mine(name, rec):
                raise CsiError(grpc.StatusCode.ABORTED,
                               f"{name} is being created by controller {rec.by}; retry")
            self.calls.in_time(name, "its claim")
            claim = self.records.write(name, rec, doc, "creating")
            if claim is None:
                continue  # another replica wrote first: see what it wrote
            # What this node added to a file of that name (staged by id
            # before it was recorded) stays: a create never tears it down.
            created = partial(self._written, name, claim, doc, "created")
            if not self._converge_at(name, merge(claim, self.files.read(name)), claim,
                                     deadline, finish=(created, None)):
                continue
            if not created():
                continue
            self.let_go(name, doc)
            return doc
        raise _contended(name)

    def update(self, name: str, change: Callable[[dict[str, Any] | None], bool],
               deadline: float, adopt: Callable[[], dict[str, Any] | None] | None = None
               ) -> dict[str, Any]:
        """ControllerExpandVolume, ControllerModifyVolume: ``change`` edits
        the document as it stands (raising for one that is not there) and
        says whether it changed. With records: converge the change on the
        revision read, then record it by compare-and-set; if another replica
        changed the record meanwhile, read it again and apply the change to
        what it says now, so neither change is lost. ``adopt``: the document
        Ceph holds for a name with neither record nor file (None: no image
        of ours), recorded before the change is made."""
        for _ in range(ATTEMPTS):
            rec = self._record(name) if self.records is not None else None
            if rec is not None and rec.state == "deleting" and \
                    self.records is not None and self.records.leased(name, rec) is None:
                self._finish_tombstone(name, rec, deadline)  # a dead delete: finished
                continue
            live = rec if rec is not None and rec.live else None
            doc = self.files.read(name)
            if self.records is not None and live is None and doc is None and \
                    self._adopt(name, rec, adopt):
                continue
            ours = self._in_flight(live, doc)
            if self.records is not None:
                doc = ours if ours is not None else self._view(name, rec, doc)
            # With a record, a call that asks for nothing new still converges
            # what the record says before it answers: Ceph may hold less (a
            # failed call's half-set limits, a change made by hand), and an
            # OK must be true. A change of our own still converging is
            # recorded by this call too (its finish would not be).
            if not change(doc) and live is None:  # raises for an absent document
                assert doc is not None
                self.settle_here(name, deadline, live)
                self.let_go(name, doc)
                return doc
            assert doc is not None
            if self.records is None or live is None:
                # No record (none kept, or a volume made before statePool):
                # the file is the state.
                self.calls.in_time(name, "its file")
                self.converge(name, doc, deadline)
                if self.records is not None and \
                        self.records.write(name, rec, doc, "created") is None:
                    continue
                self.let_go(name, doc)
                return doc
            # One replica changes a name at a time (a lease in the record):
            # two engines never resize or set the limits of one image at once.
            self._refuse_leased(name, live)
            self.calls.in_time(name, "its lease")
            lease = self.records.write(name, live, live.doc, live.state, lease=True)
            if lease is None:
                continue
            changed = partial(self._written, name, lease, doc, "created")
            # Refused or failed later: the lease let go, the record as it was.
            unchanged = partial(self.records.write, name, lease, live.doc, live.state)
            try:
                if not self._converge_at(name, doc, lease, deadline,
                                         finish=(changed, unchanged)):
                    continue
            except CsiError as exc:
                if exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL,
                                grpc.StatusCode.INVALID_ARGUMENT):
                    # Refused, failed or not loadable: the name is free at once (if Ceph does
                    # not take this write either, the lease goes stale as before;
                    # the call's own answer stands).
                    with contextlib.suppress(Exception):
                        unchanged()
                raise
            if not changed():
                continue  # the lease was taken over (it outlived stale_s)
            self.let_go(name, doc)
            return doc
        raise _contended(name)

    def _adopt(self, name: str, rec: Record | None,
               adopt: Callable[[], dict[str, Any] | None] | None) -> bool:
        """No record and no file, but Ceph may still hold the volume (its
        record was removed by hand, as the repair text of an unreadable one
        says): record what Ceph holds, so that the call goes on with it
        rather than answering NOT_FOUND or deleting nothing. False: nothing
        of ours is there."""
        assert self.records is not None
        made = adopt() if adopt is not None else None
        if made is None:
            return False
        self.calls.in_time(name, "a record rebuilt from its image")
        if self.records.write(name, rec, made, "created") is not None:
            log.warning("%s: it had no controller record, but its image carries its CSI name: "
                        "the record was rebuilt from the image", name)
        return True

    def _in_flight(self, rec: Record | None, file: dict[str, Any] | None
                   ) -> dict[str, Any] | None:
        """The document a cut-off call of this replica's is still converging:
        its lease stands and the file is of that revision. The record's own
        document is what stood *before* that call, so a later call of ours
        builds on this one: the CO saw the first cut off, not undone, and an
        answer computed on the older document would be made untrue by the
        first call's finish (a QoS removal acknowledged, then the cut-off
        call's limit converged)."""
        if self.records is None or rec is None or file is None or rec.state != "created" \
                or rec.op_by != self.records.holder or rev_of(file) != rec.rev:
            return None
        out = copy.deepcopy(file)
        labels = out["metadata"]["labels"]
        labels.pop(L_RECORD_REV, None)
        if not labels:
            del out["metadata"]["labels"]
        return out

    def _written(self, name: str, expect: Record, doc: dict[str, Any], state: str) -> bool:
        assert self.records is not None
        return self.records.write(name, expect, doc, state) is not None

    def _refuse_leased(self, name: str, rec: Record) -> None:
        assert self.records is not None
        if (by := self.records.leased(name, rec)) is not None:
            what = "being deleted" if rec.state == "deleting" else "being changed"
            raise CsiError(grpc.StatusCode.ABORTED,
                           f"{name} is {what} by controller {by}; retry")

    def delete(self, name: str, deadline: float,
               check: Callable[[dict[str, Any]], None],
               absent: Callable[[dict[str, Any]], None],
               adopt: Callable[[], dict[str, Any] | None] | None = None) -> None:
        """DeleteVolume, DeleteSnapshot, DeleteVolumeGroupSnapshot. ``check``
        refuses (raises) before anything is written; ``absent`` turns the
        document into its ``state: absent`` form. With records: a tombstone
        first (compare-and-set), then the engine deletes, then the tombstone
        becomes a marker; a refusal of the engine's puts the record back.
        ``adopt``: as for update (a volume whose record was removed by hand
        is deleted, not left behind)."""
        for _ in range(ATTEMPTS):
            rec = self._record(name) if self.records is not None else None
            live = rec if rec is not None and rec.live else None
            file = self.files.read(name)
            if self.records is None or live is None:
                if self.records is not None and file is None and \
                        self._adopt(name, rec, adopt):
                    continue
                if file is None or (self.records is not None and rev_of(file)):
                    self._drop(name)  # a leftover of a record now gone
                    return
                check(file)
                gone = copy.deepcopy(file)
                absent(gone)
                # Refused: converge puts the file back, the volume stays as it
                # was, and the CO's retry asks again.
                self.calls.in_time(name, "its file")
                self.converge(name, gone, deadline)
                self.files.remove(name)
                return
            if live.state == "creating" and not self.records.mine(name, live):
                raise CsiError(grpc.StatusCode.ABORTED,
                               f"{name} is being created by controller {live.by}; retry")
            self._refuse_leased(name, live)
            # A refused delete records this back: with a change of ours still
            # converging, that change (the image may already have grown).
            present = self._in_flight(live, file) or merge(live, file)
            check(present)  # a tombstone too: never tear down a node's side
            # The tombstone (ours now, a fresh lease: a dead replica's is
            # taken over) before the engine removes anything.
            self.calls.in_time(name, "its tombstone")
            tomb = self.records.write(name, live, present, "deleting")
            if tomb is not None and self._delete_under(name, tomb, present, absent, deadline):
                return
        raise _contended(name)

    def _delete_under(self, name: str, tomb: Record, present: dict[str, Any],
                      absent: Callable[[dict[str, Any]], None], deadline: float) -> bool:
        """The engine deletes what ``tomb`` stands over; then the tombstone
        becomes a marker. False: the record moved on meanwhile (read again).
        Refused (still open elsewhere, has snapshots): the record goes back
        to created, and the refusal is raised."""
        assert self.records is not None
        gone = copy.deepcopy(present)
        absent(gone)
        finished = partial(self.records.finish, name, tomb)
        kept = partial(self.records.write, name, tomb, present, "created")
        try:
            if not self._converge_at(name, gone, tomb, deadline, finish=(finished, kept)):
                return False
        except CsiError as exc:
            # Refused, or a document that does not load (nothing was written):
            # the record goes back too, never a tombstone left for ever.
            if exc.code in (grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.INVALID_ARGUMENT):
                kept()  # converge put the file back
            raise
        self.files.remove(name)
        self.records.finish(name, tomb)  # False: another replica finished it
        return True

    def _finish_tombstone(self, name: str, rec: Record, deadline: float) -> None:
        """A tombstone whose replica died, or is paused past its stale time,
        met by another call on the name: that delete is finished here (the
        tombstone taken over first), not answered ABORTED for ever. The
        engine's own checks stand (an image open elsewhere, or with
        snapshots, is never deleted): refused, the record goes back to
        created and the call goes on with it."""
        assert self.records is not None
        self.calls.in_time(name, "its takeover of a dead delete")
        tomb = self.records.write(name, rec, rec.doc, "deleting")
        if tomb is None:
            return  # moved on meanwhile: the caller reads it again
        log.info("%s: finishing a delete left by controller %s", name, rec.by)
        try:
            self._delete_under(name, tomb, merge(tomb, self.files.read(name)), absent_form,
                               deadline)
        except CsiError as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.info("%s: the delete left by controller %s was refused: %s", name, rec.by,
                     exc.message)

    def _drop(self, name: str) -> None:
        """A file whose record is gone: nothing of it acts again."""
        doc = self.files.read(name)
        if doc is None or not rev_of(doc):
            return
        if any(k in doc["spec"] for k in NODE_ONLY):
            self.files.commit(name, self.files.write_temp(name, node_view(doc)))
        else:
            self.files.remove(name)

    def gate(self, name: str, file: Path, step: Step) -> str | None:
        """The engine asks before each step of a chain: may the CSI file take
        it? A CSI volume never deletes a snapshot (CSI snapshots outlive their
        volume: DeleteVolume refuses while one exists, and one taken while the
        delete ran is never removed by it). With records in Ceph a file acts
        only while the record it was built from is the current one; a file of
        a record that moved on (another replica's change, a delete, a restart)
        is dropped, not converged; and a snapshot is taken only while its
        source volume is not being deleted."""
        if file.parent != self.files.dir:
            return None
        try:
            doc = self.files.read(name)
        except CsiError:
            return None  # it does not load: the daemon freezes it
        if doc is None:
            return None
        if doc.get("kind", "Volume") == "Volume" and isinstance(step, DeleteSnapshot):
            return (f"a CSI volume does not delete snapshots ({step.target}): they outlive it; "
                    "delete them first (DeleteSnapshot)")
        if self.records is None:
            return None
        if doc.get("kind") == "Snapshot" and isinstance(step, CreateSnapshot):
            why = self._source_gone(step.pool, step.image)
            if why is not None:
                return why
        rev = rev_of(doc)
        if not rev and not _controller_part(doc):
            return None  # this node's part only: its own business
        try:
            rec = self.records.get(name)
        except Exception as exc:  # unknown is not current: nothing acts
            return (f"its controller record cannot be read ({exc}); nothing is done until "
                    "it can")
        if not rev:
            # A file from before statePool, with its controller part: it acts
            # until the records say the volume was deleted (another replica
            # may have rebuilt its record from the image and deleted it).
            if rec is None or rec.state not in ("deleting", "deleted"):
                return None
            log.info("%s: deleted through the controller records: its file from before "
                     "statePool is dropped, not converged", name)
            with contextlib.suppress(CsiError), self.operation(name):
                self.files.remove(name)
            return "the controller records say it was deleted: its file is dropped"
        if rec is not None and rec.rev == rev:
            if self.records.held(rec) and self.records.expired(rev):
                # Held too long on this replica's own clock: another may be
                # about to take it over. The CO's retry claims it afresh.
                return ("this replica's claim on it is older than the stale time on its own "
                        "clock (another replica may take it over): nothing more is done on "
                        "it until a call claims it again")
            return None
        why = (f"its controller record moved on (revision {rev} is "
               + ("gone" if rec is None else f"now {rec.rev}, {rec.state}") +
               "): the file is dropped, not converged")
        try:
            with self.operation(name):  # ABORTED: the call that holds it reads again
                again = self.files.read(name)
                if again is not None and rev_of(again) == rev:
                    log.info("%s: %s", name, why)
                    self._drop(name)
        except CsiError:
            pass
        return why

    def _source_gone(self, pool: str, image: str) -> str | None:
        """Why a snapshot of ``pool/image`` must not be taken now: its volume's
        record is being deleted (or cannot be read). Checked right before the
        snapshot is cut: a volume delete writes its tombstone before its
        engine looks, so the two never both succeed."""
        source = ids.volume_name(pool, image)
        assert self.records is not None
        try:
            rec = self.records.get(source)
        except Exception as exc:  # unknown is not "there"
            return f"the source volume's record cannot be read ({exc})"
        if rec is not None and rec.state in ("deleting", "deleted"):
            return f"its source volume {source} is being deleted"
        return None

    def sweep(self) -> None:
        """At start: drop every file whose record moved on while this
        replica was away, before its engine could act on one."""
        if self.records is None:
            return
        # This replica's own leases are its dead predecessor's (one process
        # per state dir): let go, so other replicas need not wait for them
        # to go stale; that predecessor's files are then of an old revision.
        with contextlib.suppress(Exception):  # left to go stale instead
            for name, rec in self.records.all().items():
                if rec.op_by == self.records.holder and rec.state == "created":
                    self.records.write(name, rec, rec.doc, rec.state)
        with contextlib.suppress(Exception):  # swept at the next start
            if gone := self.records.sweep_deleted():
                log.info("removed %d markers of deletes finished long ago", gone)
        for name in self.files.names():
            with contextlib.suppress(Exception):  # a pass's gate asks again
                self.gate(name, self.files.path(name), SWEEP)

    @property
    def config(self) -> Config:  # the daemon may reload it (SIGHUP)
        return self.engine.config

    # -- one operation per volume ---------------------------------------------
    @contextlib.contextmanager
    def operation(self, name: str, wait_s: float = 0.0) -> Iterator[None]:
        """One call per volume at a time; ``wait_s``: wait that long for the
        one under way (else ABORTED at once, the CO retries)."""
        end = time.monotonic() + wait_s
        with self._freed:
            while name in self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    raise CsiError(grpc.StatusCode.ABORTED,
                                   f"an operation on volume {name} is already in progress; "
                                   "retry when it has finished")
                self._freed.wait(left)
            self._busy.add(name)
        try:
            yield
        finally:
            with self._freed:
                self._busy.discard(name)
                self._freed.notify_all()

    def deadline(self, context: grpc.ServicerContext) -> float:
        budget = self.config.csi.timeout_seconds
        now, remaining = time.monotonic(), context.time_remaining()
        if remaining is not None:
            budget = min(budget, remaining - DEADLINE_MARGIN_S)
        deadline = now + max(0.0, budget)
        # What the call may still start is judged by its caller's own
        # deadline (no margin: the caller still waits until then); with none,
        # by the answer's.
        self.calls.begin(context, deadline if remaining is None else now + remaining)
        return deadline

    # -- write, validate, converge -------------------------------------------
    def check(self, name: str, doc: dict[str, Any]) -> tuple[Volume, Any]:
        """Validate ``doc`` as the daemon would load it. Returns the volume and
        the temp file holding it (commit or discard it)."""
        tmp = self.files.write_temp(name, doc)
        try:
            res = load([tmp], self.config)
            if res.diagnostics or len(res.volumes) != 1:
                raise invalid("; ".join(f"{d.field}: {d.message}" for d in res.diagnostics)
                              or "the volume file does not load")
            conflicts = operator_conflicts(res.volumes, load([self.config.desired_dir],
                                                             self.config))
            if conflicts:
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"{conflicts[0].field}: {conflicts[0].message}")
            self._check_other_csi_volumes(name, res.volumes[0])
            return res.volumes[0], tmp
        except BaseException:
            self.files.discard(tmp)
            raise

    def _check_other_csi_volumes(self, name: str, vol: Volume) -> None:
        """A path another CSI volume claims, or one inside or around one of its
        paths, is refused before the file is written: the loader would fail
        the file (a mount inside another volume's mount hides it or lands in
        its data), and the other volume is left as it is."""
        mine = [(k, v) for k, v, _ in claims(vol) if k.endswith("path")]
        if not mine:
            return
        others = [self.files.path(n) for n in self.files.names() if n != name]
        for other in load(others, self.config).volumes if others else ():
            for kind, value, _ in claims(other):
                if not kind.endswith("path"):
                    continue
                for my_kind, mine_ in mine:
                    theirs = f"the {kind} {quoted(value)} of volume {other.name}"
                    if mine_ == value:
                        raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                                       f"{my_kind} {quoted(mine_)} is already used by volume "
                                       f"{other.name} (its {kind})")
                    if mine_.startswith(value.rstrip("/") + "/"):
                        raise invalid(f"{my_kind} {quoted(mine_)} is inside {theirs}; a volume "
                                      "is never mounted inside another")
                    if value.startswith(mine_.rstrip("/") + "/"):
                        raise invalid(f"{my_kind} {quoted(mine_)} contains {theirs}; a volume "
                                      "is never mounted around another")

    def converge(self, name: str, doc: dict[str, Any], deadline: float,
                 bring_up: bool = False) -> dict[str, Any]:
        """Write ``doc`` and wait for the engine. When the engine refuses or
        fails the change, the file is put back exactly as it was (or removed
        again) and the engine woken: a refused call changes nothing, and the
        volume's next call is not held up by what was refused. Past the
        deadline (or at a stop) the file stays and the work goes on."""
        previous = self.files.raw(name)
        vol, tmp = self.check(name, doc)
        self.files.commit(name, tmp)
        try:
            return self.wait(name, vol.spec_hash, deadline, bring_up)
        except CsiError as exc:
            if exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL) \
                    and not exc.keep:
                self._restore(name, previous, exc)
            raise

    def _restore(self, name: str, previous: bytes | None, exc: CsiError) -> None:
        """The file as it was before a refused or failed change (``None``:
        there was none), atomically; then the engine is woken for it."""
        try:
            self.files.put_back(name, previous)
        except OSError as err:
            log.error("%s: could not put its file back after %s: %s", name, exc.code.name, err)
            exc.message += (f"; and its file {self.files.path(name)} could not be put back "
                            f"({err.strerror or err}): fix it by hand")
            return
        self.engine.wake_volume(name)

    def wait(self, name: str, generation: str, deadline: float,
             bring_up: bool = False) -> dict[str, Any]:
        """Wake the engine for ``name`` and wait for a status that covers
        ``generation``: from a pass that began after the file was written
        (and the node was as the caller found it), with no chain for the
        volume still running."""
        def covers(status: dict[str, Any]) -> bool:
            return status.get("phase") == "Frozen" or \
                status.get("observedGeneration") == generation

        end, status = self.engine.await_status(name, covers, deadline)
        if end == "deadline":
            raise CsiError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"volume {name} has not converged yet; the work goes on "
                           "(its file stays), retry to get the result")
        if end == "stopping":
            raise CsiError(grpc.StatusCode.UNAVAILABLE,
                           "rbd-reconciler is stopping; the work resumes when it restarts")
        return self._answer(name, status, bring_up)

    def _answer(self, name: str, status: dict[str, Any], bring_up: bool) -> dict[str, Any]:
        """The engine's status as the call's answer. ``bring_up``: a stage or
        publish, which is done only when what it made can be used."""
        phase, why = status.get("phase"), status.get("message") or status.get("reason") or ""
        if phase == "Frozen":
            raise precondition(f"volume {name} is frozen: {status.get('message', '')} "
                               f"(see rbd-reconciler validate {self.config.csi_dir})")
        if phase == "Unknown":
            # Nothing was done: the node or Ceph did not answer. The CO retries.
            raise CsiError(grpc.StatusCode.UNAVAILABLE,
                           f"volume {name}: cannot observe it now ({status.get('message', '')});"
                           " nothing was changed, retry later")
        if phase == "Stalled":
            # Held as it is (no step runs on a device whose I/O does not
            # complete): the call is not done. Its file stays; the engine does
            # it when Ceph answers again, and a retry then gets OK.
            raise CsiError(grpc.StatusCode.UNAVAILABLE,
                           f"volume {name}: its I/O is not completing ({why}); nothing was "
                           "changed yet, the change is made once Ceph answers: retry")
        if phase == "Fenced":
            raise precondition(f"volume {name} is fenced, nothing was changed: {why}")
        if phase == "Failed" or status.get("lastResult") == "failed":
            if status.get("refusal"):
                raise precondition(f"volume {name}: refused: {status['refusal']}")
            raise CsiError(grpc.StatusCode.INTERNAL,
                           f"volume {name}: {status.get('lastError') or 'a step failed'}")
        if phase == "Degraded" and bring_up:
            # Made, but not usable as asked (a read-only filesystem, a publish
            # covered by another mount): kept as it is, never undone and made
            # again at each retry; a retry answers OK once it is put right.
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"volume {name} is degraded ({status.get('reason', '')}): {why}; "
                           "see rbd-reconciler explain " + name, keep=True)
        return status

    def settle(self, name: str, deadline: float, bring_up: bool = False) -> dict[str, Any]:
        """Nothing to change: still wait until the engine confirms the file as
        it is (a retry after a timeout gets the real result, not a guess)."""
        res = load([self.files.path(name)], self.config)
        if res.diagnostics or len(res.volumes) != 1:
            raise precondition(f"volume {name}'s file does not load: "
                               + "; ".join(str(d) for d in res.diagnostics))
        return self.wait(name, res.volumes[0].spec_hash, deadline, bring_up)
