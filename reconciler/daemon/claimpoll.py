"""Follow another node's claim while a volume waits on it.

A volume moved between nodes (its file leaves node A's desired directory and
arrives in node B's, one commit applied on both) reaches B while A still has
the image mapped: B is refused by A's claim (one writer per image) and backs
off, 2 s doubling to 5 min. Nothing of A's release reaches B's node: no
mount, device or file of B's changes. So while a volume is refused by
another node's claim, that claim is read from the image's header every
``events.claimPollSeconds`` (one header read, no open); once it is gone or
names another node, the volume is marked with its backoff cleared, and the
pass that follows plans it afresh (and maps it, taking the claim with the
usual compare-and-set: this only says *when* to look).

The first seconds of a wait are read more often (every FAST_S): a move's
other half, the old node's release, usually completes within a few tenths
of a second of the refusal; a claim still held after that is likely held
for long (a node gone, waiting for `takeover`), and is read at the
configured pace.

Not a RADOS watch on the header: a watch is a watcher of the image, which
the claim checks count as another client (B's own map would refuse itself,
A's re-map and any delete would see it), and A would have to notify, which
nodes of an older version do not. Only waiting volumes are read; with none,
the thread sleeps until one comes (an idle node reads nothing).

Imported by daemon/passes.py, daemon/watchers.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from reconciler.facts import meta
from reconciler.facts.claim import parse
from reconciler.observe.ceph import Session, observe_images
from reconciler.spec.config import CephConfig

log = logging.getLogger("rbd-reconciler")

Key = tuple[str, str]  # pool, image
# the images asked about -> the node holding each claim now (None: nobody);
# an image missing from the answer did not answer (unknown: nothing marked)
HolderReader = Callable[[list[Key]], dict[Key, str | None]]
Mark = Callable[[Iterable[str], str], None]

FAST_S = 0.1  # how often a claim is read during the first FAST_FOR_S of its wait
FAST_FOR_S = 2.0


@dataclass(frozen=True)
class Wait:
    volume: str
    holder: str  # the node whose claim the pass saw
    seen: int  # that pass's number: a pass that looks again is news, the same holder or not


def read_holders(cfg: CephConfig, timeout: float, session: Session | None,
                 keys: list[Key]) -> dict[Key, str | None]:
    """Header reads (no open, no watch), bounded like an observe pass's."""
    view = observe_images(cfg, keys, timeout, watchers_for=set(), session=session)
    out: dict[Key, str | None] = {}
    for key in keys:
        img = view.images.get(key)
        if img is not None:
            if meta.HOLDER in img.unreadable:
                continue  # not text: unknown, never "gone" (the pass reports it)
            claim = parse(img.meta.get(meta.HOLDER))
            out[key] = claim.node if claim is not None else None
        elif key[0] in view.listed and key not in view.image_errors:
            out[key] = None  # the image is gone, and its claim with it
    return out


class ClaimPoll:
    """One thread; ``update`` says which volumes wait on which claim, as the
    passes last saw them."""

    def __init__(self, mark: Mark, read: HolderReader, seconds: float,
                 fast: tuple[float, float] = (FAST_S, FAST_FOR_S)) -> None:
        self.mark = mark
        self.read = read
        self.seconds = seconds
        self.fast_s, self.fast_for_s = fast
        self._lock = threading.Lock()
        self._waiting: dict[Key, Wait] = {}
        self._since: dict[Key, float] = {}  # when each image's wait began (monotonic)
        # What was last reported per image: marked once, not every poll, until
        # a pass has looked at the volume again and says what it waits on now.
        self._told: dict[Key, str | None] = {}
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="claim-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def update(self, waiting: Mapping[Key, Wait]) -> None:
        with self._lock:
            for key in [k for k in self._told if self._waiting.get(k) != waiting.get(k)]:
                del self._told[key]
            now = time.monotonic()
            self._since = {k: self._since.get(k, now) for k in waiting}
            self._waiting = dict(waiting)
        self._changed.set()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=timeout)  # a stuck read: its thread is a daemon thread

    def _run(self) -> None:
        due = float("inf")  # the next read (monotonic)
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                waiting = dict(self._waiting)
                fresh = any(now - t < self.fast_for_s for t in self._since.values())
            if not waiting:  # nothing waits: no timer at all until something does
                due = float("inf")
                self._changed.wait()
                self._changed.clear()
                continue
            interval = min(self.seconds, self.fast_s) if fresh else self.seconds
            due = min(due, now + interval)  # a wait that just began: sooner
            if now < due:  # woken early by an update: only the pace may change
                self._changed.wait(due - now)
                self._changed.clear()
                continue
            try:
                holders = self.read(sorted(waiting))
            except Exception as exc:  # Ceph away: the backoff's retries still come
                log.debug("claim poll failed: %s", exc)
                holders = {}
            due = time.monotonic() + interval
            self._report(waiting, holders)

    def _report(self, waiting: Mapping[Key, Wait], now: Mapping[Key, str | None]) -> None:
        moved: dict[str, str] = {}
        with self._lock:
            for key, w in waiting.items():
                name, holder = w.volume, w.holder
                if key not in now or now[key] == holder or self._waiting.get(key) != w:
                    continue  # no answer, no change, or a pass looked again meanwhile
                if key in self._told and self._told[key] == now[key]:
                    continue
                self._told[key] = now[key]
                moved[name] = (f"claim of {key[0]}/{key[1]} released by node {holder}"
                               if now[key] is None else
                               f"claim of {key[0]}/{key[1]} moved from node {holder} "
                               f"to node {now[key]}")
        if moved:
            self.mark(sorted(moved), "; ".join(moved[n] for n in sorted(moved)))
