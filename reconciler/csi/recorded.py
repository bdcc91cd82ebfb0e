"""A CSI volume's file against its controller record in Ceph (csi.statePool):
the controller's view of a name, what a file keeps once converged, a call
cut off by its deadline finished later, a record rebuilt from its image, and
the gate the engine asks before each step (a file acts only while the record
it was built from stands), swept at start.

``RecordedFiles`` is the base of ``csi.volumes.Volumes``: imported by
csi/volumes.py only; servicers use Volumes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from reconciler.apply.outcomes import MOVED_ON
from reconciler.csi import ids
from reconciler.csi.converge import Converging
from reconciler.csi.errors import CsiError
from reconciler.csi.fileforms import (
    controller_part,
    merge,
    node_view,
    rev_of,
    with_rev,
)
from reconciler.csi.files import (
    L_ACCESS,
    L_ENCRYPTION,
    L_FSTYPE,
    L_MAPPER,
    L_RECORD_REV,
)
from reconciler.csi.records import NODE_ONLY, Record, Unreadable
from reconciler.plan.steps import CreateSnapshot, DeleteSnapshot, Step

log = logging.getLogger("rbd-reconciler.csi")

# The step the start-up sweep asks the gate about: none in particular.
SWEEP = Step("")
# What a node takes from the controller's record for a volume staged by id.
NODE_LABELS = (L_MAPPER, L_FSTYPE, L_ACCESS, L_ENCRYPTION)


class RecordedFiles(Converging):
    """The records' side of Volumes (``self.records`` None: none are kept,
    the files are the state)."""

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
        if not rev and not controller_part(doc):
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
        why = (f"its {MOVED_ON} (revision {rev} is "
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
