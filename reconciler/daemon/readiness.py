"""READY=1, tracked by the pass loop without blocking it.

READY=1 means the volumes were brought up: units ordered After= the daemon
(applications, remote-fs.target) start at boot once the first pass's chains
have ended (converged, failed or backing off), not while their volumes are
still being mapped: an application started then writes into its empty
publish directory, on the root filesystem, which the publish then hides
(seen on a systemd node: the node tests). At most a limit, then READY=1 all
the same, naming what still runs.

Never waited on: the loop goes on with file events, drift and retries
meanwhile, so one stuck volume never holds up another (safety rule 10), not
even at start. Nor does READY=1 wait for the loop: each first chain's end
(its future's callback, in the thread that ran it) and a timer at the limit
ask too, so a pass under way then (Ceph stalling) does not push READY=1
past the last chain's end or past the limit, toward the unit's
TimeoutStartSec; the loop also asks on every turn. Imported by
daemon/loop.py.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from reconciler.daemon import sdnotify

log = logging.getLogger("rbd-reconciler")

# READY=1 waits this long at most for the first pass's chains (the unit's
# TimeoutStartSec=300s sits above it: raise both together).
READY_WAIT_S = 240.0
# How often the loop looks while chains are pending, whatever wakes it (a
# chain cut short or crashed in its recording wakes nobody).
CHECK_S = 0.5


class FirstChains:
    """The first pass's chains, until they have all ended or the limit passed."""

    def __init__(self, limit: float = READY_WAIT_S) -> None:
        self.limit = limit
        self.pending: dict[str, Future[None]] = {}
        self.deadline = 0.0
        self.ready = False
        # Asked from the pass thread, the chains' threads and the timer.
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def begin(self, inflight: dict[str, Future[None]]) -> None:
        """The first pass ended: ``inflight`` is what it started (a copy)."""
        with self._lock:
            self.pending = dict(inflight)
            if not self.pending:
                self._notify()
                return
            sdnotify.notify(f"STATUS=starting: bringing up {len(self.pending)} volume(s)")
            self.deadline = time.monotonic() + self.limit
            self._timer = threading.Timer(self.limit, self.check, kwargs={"at_limit": True})
            self._timer.daemon = True
            self._timer.start()
            futures = list(self.pending.values())
        for f in futures:  # one already done calls back at once (the lock is free)
            f.add_done_callback(lambda _f: self.check())

    def check(self, at_limit: bool = False) -> float:
        """READY=1 if due; the longest the loop may wait before asking again.
        ``at_limit``: the timer's call (its wait ended: the limit is reached)."""
        with self._lock:
            if self.ready:
                return float("inf")
            self.pending = {n: f for n, f in self.pending.items() if not f.done()}
            if not self.pending:
                self._notify()
                return float("inf")
            if at_limit or time.monotonic() >= self.deadline:
                log.warning("ready after %g s with volume(s) still converging: %s",
                            self.limit, ", ".join(sorted(self.pending)))
                self._notify()
                return float("inf")
            return min(CHECK_S, max(0.0, self.deadline - time.monotonic()))

    def stopping(self) -> None:
        """A stop ends the wait at once (READY=1 all the same, as before)."""
        with self._lock:
            if not self.ready:
                self._notify()

    def _notify(self) -> None:
        """Under the lock: READY=1, once."""
        self.ready = True
        if self._timer is not None:
            self._timer.cancel()
        sdnotify.notify("READY=1")
