"""Turning a CSI call into a desired-volume file and waiting for the engine.

Each call edits one file: validate the new content exactly as the daemon will
load it, rename it into place, wake the daemon for that volume, and wait
until its status covers what was written (observedGeneration = the spec
hash). One call per volume at a time: a second one is ABORTED.

``Converging`` is the base of ``csi.volumes.Volumes`` (through
csi/recorded.py): imported by csi/recorded.py only; servicers use Volumes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from reconciler.csi.calls import Calls
from reconciler.csi.errors import CsiError, invalid, precondition, quoted
from reconciler.csi.files import VolumeFiles
from reconciler.csi.records import Records
from reconciler.spec.config import Config
from reconciler.spec.desired import claims, operator_conflicts
from reconciler.spec.loader import load
from reconciler.spec.model import Volume

if TYPE_CHECKING:
    from reconciler.engine import Served

log = logging.getLogger("rbd-reconciler.csi")
DEADLINE_MARGIN_S = 0.25  # answer before the caller's deadline cuts us off


class Converging:
    """One volume file written, validated, converged and waited for; one
    call per volume at a time."""

    def __init__(self, engine: Served) -> None:
        self.engine = engine
        self.files = VolumeFiles(engine.config.csi_dir)
        self._guard = threading.Lock()
        self._freed = threading.Condition(self._guard)  # a name's call ended
        self._busy: set[str] = set()
        self.calls = Calls()
        self.records: Records | None = None  # csi.statePool: the server sets it

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
