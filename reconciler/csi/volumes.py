"""The CSI controller's calls on a volume's state: create, update and
delete, with records in Ceph (csi.statePool: claimed, leased and tombstoned
by compare-and-set, a dead replica's delete finished, a volume whose record
was removed by hand adopted) or with the files alone.

``Volumes`` is what the servicers hold (csi/controller.py, node.py,
groups.py, snapshots.py, server.py); its bases are csi/recorded.py (the
records against the files, the gate) and csi/converge.py (write, validate,
converge one file).

Imported by csi/ (5 modules).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc

from reconciler.csi.errors import CsiError
from reconciler.csi.fileforms import absent_form, merge, rev_of
from reconciler.csi.recorded import RecordedFiles
from reconciler.csi.records import Record

log = logging.getLogger("rbd-reconciler.csi")

# Reads and compare-and-sets of one call before it answers ABORTED (another
# replica changed the record every time).
ATTEMPTS = 4


def _contended(name: str) -> CsiError:
    return CsiError(grpc.StatusCode.ABORTED,
                    f"the controller record of {name} kept changing under this call (other "
                    "replicas are changing it); nothing is lost: retry")

class Volumes(RecordedFiles):
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
