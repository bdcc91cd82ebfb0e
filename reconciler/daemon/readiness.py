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
TimeoutStartSec; the loop also asks on every turn.

Nor does it wait for a volume that is known not to come up soon: one the
first pass found unknown (its pool, or its image, did not answer within
observeTimeoutSeconds: Ceph unreachable at boot) never had a chain, and
one whose first chain is still running when a probe of its image finds its
pool (or image) not answering within that timeout (Ceph gone while it
converged) is no longer waited for. A volume converging on a cluster that
answers still is. READY=1 then says, in the log and in STATUS=, which
volumes were not waited for and why. Imported by daemon/loop.py
(daemon/service.py gives it the probe: its Node's Ceph connection).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from reconciler.daemon import sdnotify
from reconciler.spec.diagnostics import escaped

log = logging.getLogger("rbd-reconciler")

# READY=1 waits this long at most for the first pass's chains (the unit's
# TimeoutStartSec=300s sits above it: raise both together).
READY_WAIT_S = 240.0
# How often the loop looks while chains are pending, whatever wakes it (a
# chain cut short or crashed in its recording wakes nobody).
CHECK_S = 0.5
# While first chains run, their images are probed this often: a pool (or an
# image) that does not answer within observeTimeoutSeconds is not waited for.
PROBE_EVERY_S = 5.0

# Given the names of the first chains still running: those whose pool or
# image did not answer (name -> why). One that raises is logged; the wait
# goes on, and the next probe tries again.
Probe = Callable[[list[str]], dict[str, str]]


class FirstChains:
    """The first pass's chains, until they have all ended or the limit passed."""

    def __init__(self, limit: float = READY_WAIT_S, probe: Probe | None = None,
                 probe_every: float = PROBE_EVERY_S) -> None:
        self.limit = limit
        self.pending: dict[str, Future[None]] = {}
        self.deadline = 0.0
        self.ready = False
        # Not waited for: name -> why (unknown to the first pass, or probed).
        self.not_waited: dict[str, str] = {}
        self.probe = probe  # set by the daemon (its Node's Ceph connection)
        self.probe_every = probe_every
        # Asked from the pass thread, the chains' threads, the timer and the prober.
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._probing = threading.Event()  # set: the prober stops

    def not_waiting(self, why: dict[str, str]) -> None:
        """Volumes a pass found unknown (name -> why): before READY=1, they
        are not waited for, and READY=1 says so. A pass that sees one again
        (Ceph answering) takes it back: it is then named no longer."""
        with self._lock:
            if self.ready:
                return
            self.not_waited.update(why)

    def seen(self, names: set[str], inflight: dict[str, Future[None]] | None = None) -> None:
        """Volumes a pass looked at and did not find unknown. ``inflight``:
        the chains in flight after it (a copy); one of a volume not waited
        for until now (Ceph answering again) is waited for from now on,
        within the same limit: it converges on a cluster that answers."""
        late: list[Future[None]] = []
        with self._lock:
            if self.ready:
                return
            for name in names:
                if (self.not_waited.pop(name, None) is not None and self.deadline
                        and inflight is not None and name in inflight):
                    self.pending[name] = inflight[name]
                    late.append(inflight[name])
        for f in late:  # outside the lock: one already done calls back at once
            f.add_done_callback(lambda _f: self.check())

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
            if self.probe is not None:
                threading.Thread(target=self._prober, name="ready-probe", daemon=True).start()
        for f in futures:  # one already done calls back at once (the lock is free)
            f.add_done_callback(lambda _f: self.check())

    def _prober(self) -> None:
        """Its own thread: probe the images of the chains still running,
        every ``probe_every`` s, until READY=1. Never the loop's, never a
        chain's: a probe that hangs holds up nothing (it is bounded too)."""
        while not self._probing.wait(self.probe_every):
            with self._lock:
                if self.ready:
                    return
                names = sorted(n for n, f in self.pending.items() if not f.done())
            if not names:
                continue
            assert self.probe is not None
            try:
                found = self.probe(names)
            except Exception as exc:  # a probe is never worth a dead thread
                log.warning("ready: probe of %s failed: %s", ", ".join(names), exc)
                continue
            with self._lock:
                if self.ready:
                    return
                for name, why in found.items():
                    if self.pending.pop(name, None) is not None:
                        log.warning("ready: %s not waited for: its chain runs on, but %s",
                                    name, why)
                        self.not_waited[name] = why
            self.check()

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
        """Under the lock: READY=1, once; STATUS= and the log name what was
        not waited for, and why."""
        self.ready = True
        self._probing.set()
        if self._timer is not None:
            self._timer.cancel()
        if self.not_waited:
            # One line: sd_notify's assignments are newline-separated, and a
            # reason (Ceph's error text) must not add its own.
            said = escaped(not_waited_line(self.not_waited))
            log.warning("ready; %s", said)
            sdnotify.notify(f"STATUS=ready; {said}")
        sdnotify.notify("READY=1")


def not_waited_line(not_waited: dict[str, str]) -> str:
    """One line: the volumes not waited for, those with one reason together."""
    by_why: dict[str, list[str]] = {}
    for name, why in sorted(not_waited.items()):
        by_why.setdefault(why, []).append(name)
    return (f"{len(not_waited)} volume(s) not waited for: "
            + "; ".join(f"{', '.join(names)} ({why})" for why, names in by_why.items()))
