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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from reconciler.csi.errors import CsiError, invalid, precondition, quoted
from reconciler.csi.files import VolumeFiles
from reconciler.csi.records import NODE_ONLY, Records
from reconciler.spec.config import Config
from reconciler.spec.desired import claims, operator_conflicts
from reconciler.spec.loader import load
from reconciler.spec.model import Volume

if TYPE_CHECKING:
    from reconciler.engine import Served

log = logging.getLogger("rbd-reconciler.csi")
DEADLINE_MARGIN_S = 0.25  # answer before the caller's deadline cuts us off


class Volumes:
    def __init__(self, engine: Served) -> None:
        self.engine = engine
        self.files = VolumeFiles(engine.config.csi_dir)
        self._guard = threading.Lock()
        self._busy: set[str] = set()
        self.records: Records | None = None  # csi.statePool: the server sets it

    # -- the controller's records in Ceph (csi.statePool) ------------------------
    def read(self, name: str) -> dict[str, Any] | None:
        """The controller's view of ``name``. With records in Ceph the record
        is the truth for the controller's part (another replica may have
        grown, modified or deleted it since), with what this node added
        (stage, publish) from its file. Nothing is written: a call that
        changes the volume writes its file (converge), then lets it go."""
        doc = self.files.read(name)
        if self.records is None:
            return doc
        rec = self.records.get(name)
        if rec is None or (rec.state == "creating" and (rec.by == self.records.holder
                                                         or self.records.stale(rec))):
            # Not recorded (made before statePool, or not at all); ours, cut
            # off before it was recorded; or left by a replica that died: a
            # create takes it over (claim).
            return doc
        if rec.state != "created":
            raise CsiError(grpc.StatusCode.ABORTED,
                           f"{name} is being created by controller {rec.by}; retry")
        merged = copy.deepcopy(rec.doc)
        for key in NODE_ONLY:
            if doc is not None and key in doc["spec"]:
                merged["spec"][key] = doc["spec"][key]
        return merged

    def let_go(self, name: str, doc: dict[str, Any]) -> None:
        """With records in Ceph, a converged controller-only file is removed
        (the daemon forgets it: nothing is mapped): a file left behind would
        be converged again after another replica deleted or changed the
        volume, and bring a deleted image back. A file with a stage, publish
        or map is this node's and stays."""
        if self.records is not None and not any(k in doc["spec"] for k in NODE_ONLY):
            self.files.remove(name)

    def settle_here(self, name: str, deadline: float) -> None:
        """settle() when this replica has the file (a call of its own still
        converging); with records and no file, there is nothing to wait for."""
        if self.records is None or self.files.path(name).exists():
            self.settle(name, deadline)

    def names(self) -> list[str]:
        """Every name the controller answers for: its files, and with records
        in Ceph every created one (rebuilt here when it is read)."""
        names = set(self.files.names())
        if self.records is not None:
            names.update(n for n, r in self.records.all().items() if r.state == "created")
        return sorted(names)

    def claim(self, name: str, doc: dict[str, Any]) -> None:
        """Before a create: this replica holds the name, or the CO retries."""
        if self.records is None:
            return
        have = self.records.claim(name, doc)
        if have is not None:
            what = "is being created" if have.state == "creating" else "was just created"
            raise CsiError(grpc.StatusCode.ABORTED,
                           f"{name} {what} by controller {have.by}; retry")

    def record(self, name: str, doc: dict[str, Any]) -> None:
        """After a create, expand or modify converged: the record, then the
        file let go."""
        if self.records is not None:
            self.records.put(name, doc)
            self.let_go(name, doc)

    def finish(self, name: str, doc: dict[str, Any]) -> None:
        """A create retried after this replica was cut off between converging
        and recording: its claim still says "creating"; now it is created."""
        if self.records is None:
            return
        rec = self.records.get(name)
        if rec is not None and rec.state == "creating" and rec.by == self.records.holder:
            self.records.put(name, doc)
        self.let_go(name, doc)

    def forget(self, name: str) -> None:
        if self.records is not None:
            self.records.forget(name)

    @property
    def config(self) -> Config:  # the daemon may reload it (SIGHUP)
        return self.engine.config

    # -- one operation per volume ---------------------------------------------
    @contextlib.contextmanager
    def operation(self, name: str) -> Iterator[None]:
        with self._guard:
            if name in self._busy:
                raise CsiError(grpc.StatusCode.ABORTED,
                               f"an operation on volume {name} is already in progress; "
                               "retry when it has finished")
            self._busy.add(name)
        try:
            yield
        finally:
            with self._guard:
                self._busy.discard(name)

    def deadline(self, context: grpc.ServicerContext) -> float:
        budget = self.config.csi.timeout_seconds
        remaining = context.time_remaining()
        if remaining is not None:
            budget = min(budget, remaining - DEADLINE_MARGIN_S)
        return time.monotonic() + max(0.0, budget)

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

    def converge(self, name: str, doc: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Write ``doc`` and wait for the engine. When the engine refuses or
        fails the change, the file is put back exactly as it was (or removed
        again) and the engine woken: a refused call changes nothing, and the
        volume's next call is not held up by what was refused. Past the
        deadline (or at a stop) the file stays and the work goes on."""
        previous = self.files.raw(name)
        vol, tmp = self.check(name, doc)
        self.files.commit(name, tmp)
        try:
            return self.wait(name, vol.spec_hash, deadline)
        except CsiError as exc:
            if exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL):
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

    def retire(self, name: str, before: dict[str, Any], after: dict[str, Any],
               deadline: float) -> None:
        """Converge ``after`` (the file with ``state: absent``), then remove the
        file. A refusal puts ``before`` back: the object stays as it was and the
        CO's retry asks again."""
        try:
            self.converge(name, after, deadline)
        except CsiError as exc:
            if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                self.files.commit(name, self.files.write_temp(name, before))
                self.engine.wake_volume(name)
                self.let_go(name, before)  # with records: the record stands for it
            raise
        self.files.remove(name)

    def wait(self, name: str, generation: str, deadline: float) -> dict[str, Any]:
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
        return self._answer(name, status)

    def _answer(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        phase = status.get("phase")
        if phase == "Frozen":
            raise precondition(f"volume {name} is frozen: {status.get('message', '')} "
                               f"(see rbd-reconciler validate {self.config.csi_dir})")
        if phase == "Unknown":
            # Nothing was done: the node or Ceph did not answer. The CO retries.
            raise CsiError(grpc.StatusCode.UNAVAILABLE,
                           f"volume {name}: cannot observe it now ({status.get('message', '')});"
                           " nothing was changed, retry later")
        if phase == "Failed" or status.get("lastResult") == "failed":
            if status.get("refusal"):
                raise precondition(f"volume {name}: refused: {status['refusal']}")
            raise CsiError(grpc.StatusCode.INTERNAL,
                           f"volume {name}: {status.get('lastError') or 'a step failed'}")
        return status

    def settle(self, name: str, deadline: float) -> dict[str, Any]:
        """Nothing to change: still wait until the engine confirms the file as
        it is (a retry after a timeout gets the real result, not a guess)."""
        res = load([self.files.path(name)], self.config)
        if res.diagnostics or len(res.volumes) != 1:
            raise precondition(f"volume {name}'s file does not load: "
                               + "; ".join(str(d) for d in res.diagnostics))
        return self.wait(name, res.volumes[0].spec_hash, deadline)
