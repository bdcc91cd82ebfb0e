"""What tells the Daemon when to look, and at what: inotify on the desired
files' paths (daemon/dirwatch.py), the node's events (daemon/events.py),
the claim poll (daemon/claimpoll.py) and the git source's thread
(daemon/follow.py), started and kept in step with the config. A part of
the Daemon (daemon/service.py, its only importer), sharing its state: the
attributes below are the Daemon's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from reconciler.daemon.claimpoll import ClaimPoll, read_holders
from reconciler.daemon.dirwatch import DirWatcher
from reconciler.daemon.dirwatch import plan as watch_plan
from reconciler.daemon.events import EventHub
from reconciler.daemon.follow import Follower
from reconciler.daemon.loop import PassLoop
from reconciler.daemon.metrics import Metrics
from reconciler.drivers.run import Halt
from reconciler.observe.ceph import observe_images
from reconciler.observe.node import Node
from reconciler.spec.config import Config

log = logging.getLogger("rbd-reconciler")


class Watchers:
    """The watcher methods of the Daemon (daemon/service.py)."""

    config: Config
    node: Node
    halt: Halt
    lock: threading.Lock
    loop: PassLoop
    metrics: Metrics
    dirwatch: DirWatcher | None
    events: EventHub | None
    follower: Follower | None
    claim_poll: ClaimPoll | None

    def _watch(self) -> None:
        """Watch what can change the desired files (daemon/dirwatch.py): the
        paths are resolved again every pass, so the watches follow a link
        swapped anywhere on the way (git-sync, a deploy keeping releases)."""
        if self.dirwatch is None:
            try:
                self.dirwatch = DirWatcher(self.loop.wake, self._events_lost)
            except OSError as exc:  # no inotify left (fs.inotify.max_user_instances)
                log.warning("events: not watching the desired files (%s); they are looked "
                            "at every %g s", exc, self.config.resync_seconds)
                return
            self.dirwatch.start()
        self.dirwatch.watch(watch_plan([self.config.desired_dir], [self.config.csi_dir]))

    def _events_lost(self) -> None:
        """The kernel dropped file events (its queue overflowed): what changed
        is unknown, so the next pass looks at every volume."""
        self.loop.mark_dirty(None, "file events lost (inotify queue overflow)")

    def _start_events(self) -> None:
        poll = self.config.events.image_poll_seconds
        self.events = EventHub(self.loop.mark_dirty, self._image_sizes, poll,
                               io_watch=lambda: self.node.io_watch,
                               io_poll_seconds=self.config.events.io_poll_seconds)
        try:
            self.events.start()
        except OSError as exc:  # no /proc/self/mountinfo to poll: the resync still runs
            log.warning("events: not watching the node (%s); drift is repaired at the "
                        "resync, every %g s", exc, self.config.resync_seconds)
            self.events = None
        if self.config.events.claim_poll_seconds > 0:
            self.claim_poll = ClaimPoll(self._claim_moved, self._claim_holders,
                                        self.config.events.claim_poll_seconds)
            self.claim_poll.start()

    def _claim_holders(self, images: list[tuple[str, str]]) -> dict[tuple[str, str], str | None]:
        node = self.node  # the current one: a reload makes a new one
        return read_holders(node.config.ceph, node.config.observe_timeout_seconds,
                            node.ceph_session, images)

    def _claim_moved(self, names: Iterable[str], why: str) -> None:
        """The claim that refused these volumes is gone (or another node's
        now): what they were refused on no longer holds, so they are tried
        at once rather than when their backoff ends."""
        names = list(names)
        self.loop.retry_now(names)
        log.info("%s: %s; looking again", ", ".join(names), why)
        self.loop.mark_dirty(names, why)

    def _start_source(self) -> None:
        """Follow the git source (docs/gitops-source.md) in a thread of its own."""
        if self.config.git is None or self.follower is not None:
            return
        self.follower = Follower(lambda: self.config, self.metrics, self.halt,
                                 lambda rev: self.loop.mark_dirty(None, f"source applied {rev}"))
        self.follower.start()

    def _image_sizes(self, images: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """Header reads (no open, no watch), bounded like observe's."""
        node = self.node
        view = observe_images(node.config.ceph, images, node.config.observe_timeout_seconds,
                              watchers_for=set(), session=node.ceph_session)
        return {key: img.size for key, img in view.images.items()}
