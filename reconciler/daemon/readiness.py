"""READY=1, tracked by the pass loop without blocking it.

READY=1 means the volumes were brought up: units ordered After= the daemon
(applications, remote-fs.target) start at boot once the first pass's chains
have ended (converged, failed or backing off), not while their volumes are
still being mapped: an application started then writes into its empty
publish directory, on the root filesystem, which the publish then hides
(seen on a systemd node: the node tests). At most a limit, then READY=1 all
the same, naming what still runs.

The loop asks on every turn (a chain's end wakes it); meanwhile it goes on
with file events, drift and retries: one stuck volume never holds up
another (safety rule 10), not even at start. Imported by daemon/loop.py.
"""

from __future__ import annotations

import logging
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

    def begin(self, inflight: dict[str, Future[None]]) -> None:
        """The first pass ended: ``inflight`` is what it started (a copy)."""
        self.pending = dict(inflight)
        if not self.pending:
            self._notify()
            return
        sdnotify.notify(f"STATUS=starting: bringing up {len(self.pending)} volume(s)")
        self.deadline = time.monotonic() + self.limit

    def check(self) -> float:
        """READY=1 if due; the longest the loop may wait before asking again."""
        if self.ready:
            return float("inf")
        self.pending = {n: f for n, f in self.pending.items() if not f.done()}
        if not self.pending:
            self._notify()
            return float("inf")
        if time.monotonic() >= self.deadline:
            log.warning("ready after %g s with volume(s) still converging: %s", self.limit,
                        ", ".join(sorted(self.pending)))
            self._notify()
            return float("inf")
        return min(CHECK_S, max(0.0, self.deadline - time.monotonic()))

    def stopping(self) -> None:
        """A stop ends the wait at once (READY=1 all the same, as before)."""
        if not self.ready:
            self._notify()

    def _notify(self) -> None:
        self.ready = True
        sdnotify.notify("READY=1")
