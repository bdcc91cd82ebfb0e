"""What tells the daemon when to look, and at what: inotify on the desired
files' paths (daemon/dirwatch.py), the node's events (daemon/events.py),
the claim poll (daemon/claimpoll.py) and the git source's thread
(daemon/follow.py) with its fleet's gate and report (daemon/rollout.py),
started, kept in step with the config and stopped.
Each marks volumes for the next pass through the pass loop
(daemon/loop.py); the passes tell them what belongs to which volume.
Built by daemon/service.py; imported by it and daemon/passes.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from reconciler.daemon.claimpoll import ClaimPoll, Key, Wait, read_holders
from reconciler.daemon.dirwatch import DirWatcher
from reconciler.daemon.dirwatch import plan as watch_plan
from reconciler.daemon.events import EventHub
from reconciler.daemon.follow import Follower
from reconciler.daemon.interest import VolumeInterest, combine
from reconciler.daemon.loop import PassLoop
from reconciler.daemon.metrics import Metrics
from reconciler.daemon.rollout import Rollouts
from reconciler.drivers.run import Halt
from reconciler.observe.ceph import observe_images
from reconciler.observe.node import Node
from reconciler.spec.config import Config

log = logging.getLogger("rbd-reconciler")


class Watchers:
    def __init__(self, config: Callable[[], Config], node: Callable[[], Node], halt: Halt,
                 loop: PassLoop, metrics: Metrics, rollout: Rollouts | None = None) -> None:
        self.config = config  # the current one: a reload (SIGHUP) replaces it
        self.node = node  # likewise
        self.halt = halt  # the git source's commands stop with the daemon's
        self.loop = loop  # what they wake and mark
        self.metrics = metrics  # the git source's
        self.dirwatch: DirWatcher | None = None  # inotify on the desired files' paths
        self.events: EventHub | None = None
        self.follower: Follower | None = None  # the GitOps source (config.git)
        self.claim_poll: ClaimPoll | None = None
        self.rollout = rollout  # the fleet's gate and this node's report (source.fleet)

    def watch(self) -> None:
        """Watch what can change the desired files (daemon/dirwatch.py): the
        paths are resolved again every pass, so the watches follow a link
        swapped anywhere on the way (git-sync, a deploy keeping releases)."""
        config = self.config()
        if self.dirwatch is None:
            try:
                self.dirwatch = DirWatcher(self.loop.wake, self._events_lost)
            except OSError as exc:  # no inotify left (fs.inotify.max_user_instances)
                log.warning("events: not watching the desired files (%s); they are looked "
                            "at every %g s", exc, config.resync_seconds)
                return
            self.dirwatch.start()
        self.dirwatch.watch(watch_plan([config.desired_dir], [config.csi_dir]))

    def _events_lost(self) -> None:
        """The kernel dropped file events (its queue overflowed): what changed
        is unknown, so the next pass looks at every volume."""
        self.loop.mark_dirty(None, "file events lost (inotify queue overflow)")

    def start_events(self) -> None:
        config = self.config()
        poll = config.events.image_poll_seconds
        self.events = EventHub(self.loop.mark_dirty, self._image_sizes, poll,
                               io_watch=lambda: self.node().io_watch,
                               io_poll_seconds=config.events.io_poll_seconds)
        try:
            self.events.start()
        except OSError as exc:  # no /proc/self/mountinfo to poll: the resync still runs
            log.warning("events: not watching the node (%s); drift is repaired at the "
                        "resync, every %g s", exc, config.resync_seconds)
            self.events = None
        if config.events.claim_poll_seconds > 0:
            self.claim_poll = ClaimPoll(self._claim_moved, self._claim_holders,
                                        config.events.claim_poll_seconds)
            self.claim_poll.start()

    def follow_interest(self, interest: dict[str, VolumeInterest]) -> None:
        """What of the node belongs to which volume (daemon/interest.py), for
        the node's events."""
        if self.events is not None:
            self.events.update(combine(interest))

    def poll_claims(self, waits: Mapping[Key, Wait]) -> None:
        """The claims of other nodes that refused volumes, for the claim poll."""
        if self.claim_poll is not None:
            self.claim_poll.update(waits)

    def _claim_holders(self, images: list[tuple[str, str]]) -> dict[tuple[str, str], str | None]:
        node = self.node()  # the current one: a reload makes a new one
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

    def start_source(self) -> None:
        """Follow the git source (docs/gitops-source.md) in a thread of its own."""
        if self.config().git is None or self.follower is not None:
            return
        self.follower = Follower(self.config, self.metrics, self.halt,
                                 lambda rev: self.loop.mark_dirty(None, f"source applied {rev}"),
                                 self.rollout)
        self.follower.start()
        if self.rollout is not None:
            self.rollout.start()

    def reloaded(self) -> None:
        """The config was reloaded: the git source started, stopped or synced
        at once, the desired files' paths watched as they are now."""
        self.start_source()
        if self.follower is not None and self.config().git is None:
            self.follower.stop(timeout=1.0)
            self.follower = None
        elif self.follower is not None:
            self.follower.sync_now()
        self.watch()

    def _image_sizes(self, images: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """Header reads (no open, no watch), bounded like observe's."""
        node = self.node()
        view = observe_images(node.config.ceph, images, node.config.observe_timeout_seconds,
                              watchers_for=set(), session=node.ceph_session)
        return {key: img.size for key, img in view.images.items()}

    def stop(self, deadline: float) -> None:
        """Each thread stopped, waiting for it until a second past ``deadline``
        (at least 0.1 s, at most 2 s each)."""
        for thread in (self.dirwatch, self.events, self.follower, self.claim_poll,
                       self.rollout):
            if thread is not None:
                thread.stop(timeout=max(0.1, min(2.0, deadline + 1 - time.monotonic())))
