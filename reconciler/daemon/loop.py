"""The pass loop: when the next pass runs, and what it looks at.

Wake-ups (an event, a CSI call, the command line, a chain's end), the
debounce after a burst, the periodic resync, the retries of failing
volumes (exponential backoff with jitter, forgotten when the spec
changes), and READY=1 (daemon/readiness.py), asked on every turn without
ever blocking it. The pass itself is daemon/passes.py's. Built by
daemon/service.py, which shares its lock with it (the in-flight chains,
the records and the backoff change together); imported by it and by the
rooms it gives the loop to (daemon/passes.py, daemon/chains.py,
daemon/watchers.py).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from reconciler.daemon.readiness import FirstChains
from reconciler.spec.model import Volume

DEBOUNCE_S = 0.05  # quiet time after an event burst (a git pull touching 50 files)
DEBOUNCE_MAX_S = 1.0  # ...but never wait longer than this after the first event
BACKOFF_BASE_S = 2.0
BACKOFF_MAX_S = 300.0


@dataclass
class Backoff:
    failures: int
    until: float
    spec_hash: str


def next_backoff(prev: Backoff | None, spec_hash: str) -> tuple[Backoff, float]:
    """After a failed chain: the backoff, and its delay in seconds."""
    n = (prev.failures + 1) if prev and prev.spec_hash == spec_hash else 1
    delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (n - 1))
    delay *= random.uniform(0.5, 1.0)  # jitter: failing volumes do not align
    return Backoff(n, time.monotonic() + delay, spec_hash), delay


class PassLoop:
    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock  # the daemon's: records, in-flight set, backoff
        self.wake_event = threading.Event()
        # A wake that skips the debounce: a CSI call or the command line waits.
        self.urgent = threading.Event()
        self.backoff: dict[str, Backoff] = {}
        # What the next pass looks at (names); everything while ``dirty_all``.
        self.dirty: set[str] = set()
        self.dirty_all = True
        self.dirty_why: list[str] = []  # for the debug line of the next pass
        self.last_hash: dict[str, str] = {}  # name -> spec_hash at the last pass
        self.last_pass_start = 0.0
        self.first_chains = FirstChains()  # READY=1 once the first pass's chains ended

    def wake(self) -> None:
        self.wake_event.set()

    def mark_dirty(self, names: Iterable[str] | None, why: str) -> None:
        """Have the next pass look at ``names`` (None: at every volume)."""
        with self.lock:
            if names is None:
                self.dirty_all = True
            else:
                self.dirty.update(names)
            if len(self.dirty_why) < 20:
                self.dirty_why.append(why)
        self.wake_event.set()

    def wake_volume(self, name: str) -> None:
        """A pass at once, without the debounce, that tries ``name`` even if it
        is backing off: a CSI call (maybe the CO's retry) is waiting on it."""
        with self.lock:
            self.backoff.pop(name, None)
            self.dirty.add(name)
        self.urgent.set()
        self.wake_event.set()

    def look_again(self, names: set[str] | None, why: str) -> None:
        """A pass at once over ``names`` (None: every volume), backoff
        forgotten, no debounce: the command line waits on it."""
        with self.lock:
            if names is None:
                self.dirty_all = True
                self.backoff.clear()
            else:
                for name in names:
                    self.backoff.pop(name, None)
                self.dirty |= names
            if len(self.dirty_why) < 20:
                self.dirty_why.append(why)
        self.urgent.set()
        self.wake_event.set()

    def retry_now(self, names: Iterable[str]) -> None:
        """Their backoff forgotten (what they failed on changed)."""
        with self.lock:
            for name in names:
                self.backoff.pop(name, None)

    def take_dirty(self, current: dict[str, Volume], release: list[Volume]
                   ) -> tuple[set[str], list[str]]:
        """The names this pass looks at, and why; the dirty set starts afresh."""
        now = time.monotonic()
        with self.lock:
            every, names, why = self.dirty_all, self.dirty, self.dirty_why
            self.dirty, self.dirty_all, self.dirty_why = set(), False, []
            due = {n for n, b in self.backoff.items() if b.until <= now}
            self.last_pass_start = now
        changed = {n for n, v in current.items() if self.last_hash.get(n) != v.spec_hash}
        self.last_hash = {n: v.spec_hash for n, v in current.items()}
        if every:
            return set(current) | {v.name for v in release}, why
        if changed:
            why = [*why, f"{len(changed)} new or changed"]
        return names | changed | due | {v.name for v in release}, why

    def due(self, v: Volume, inflight: dict[str, Future[None]]) -> bool:
        """Not in flight, and not backing off (or its spec changed since)."""
        with self.lock:
            if v.name in inflight:
                return False
            b = self.backoff.get(v.name)
            if b is None:
                return True
            if b.spec_hash != v.spec_hash:  # a new spec deserves a try at once
                del self.backoff[v.name]
                return True
            return time.monotonic() >= b.until

    def next_retry(self) -> float:
        """When the next backoff ends that the last pass could not yet retry."""
        with self.lock:
            return min((b.until for b in self.backoff.values()
                        if b.until > self.last_pass_start), default=float("inf"))

    def debounce(self) -> None:
        first = time.monotonic()
        self.wake_event.clear()
        while time.monotonic() - first < DEBOUNCE_MAX_S:
            if not self.wake_event.wait(DEBOUNCE_S):
                return
            self.wake_event.clear()
            if self.urgent.is_set():  # the command line waits: no more quiet time
                self.urgent.clear()
                return

    def run(self, one_pass: Callable[[], None], inflight: Callable[[], dict[str, Future[None]]],
            resync_seconds: Callable[[], float], stopping: threading.Event,
            reload_wanted: threading.Event, reload: Callable[[], None]) -> None:
        """The first pass, then a pass whenever one is due, until ``stopping``.
        ``inflight``: a copy of the chains in flight, taken under the lock."""
        one_pass()
        # READY=1 once the first pass's chains have ended: asked on every
        # turn, never waited on, so that one stuck volume holds up nothing
        # else meanwhile (safety rule 10).
        self.first_chains.begin(inflight())
        next_resync = time.monotonic() + resync_seconds()
        while not stopping.is_set():
            retry = self.next_retry()
            ready_check = self.first_chains.check()
            wait = min(min(next_resync, retry) - time.monotonic(), ready_check)
            woke = self.wake_event.wait(max(0.0, wait))
            if stopping.is_set():
                break
            if woke and self.urgent.is_set():
                self.urgent.clear()
                self.wake_event.clear()
            elif woke:
                self.debounce()
            if reload_wanted.is_set():
                reload()
            now = time.monotonic()
            if now >= next_resync:
                self.mark_dirty(None, "resync")
                self.wake_event.clear()
                next_resync = now + resync_seconds()
            if woke or now >= retry or self.dirty_all:
                one_pass()
        self.first_chains.stopping()
