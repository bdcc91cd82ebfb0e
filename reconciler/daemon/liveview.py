"""What ``status``, ``plan`` and ``explain`` through the daemon answer from
(daemon/commands.py): the files as the daemon's last pass loaded them (what
it converges the node to), and a look at the node and Ceph begun after the
question, as true as the command's own look would be.

A view the passes keep goes stale exactly when it matters: nothing wakes an
idle volume's pass when Ceph stops answering or another node takes the
image over, so it said ``MAPPED`` where a look said ``UNKNOWN`` or
``FENCED`` (issue 37). So every answer looks again: the same observe and
planner as the command alone (engine.look), through the daemon's warm
Ceph connection and with its I/O history (a stall it has watched for
longer than the command's one-second sample). Looks run one at a time, and
a question is served by a look that began after it was asked, so a burst of
health checks costs one or two looks, not one each.

Written by the pass thread (``loaded``) and read by the control socket's
threads; looks are made in those threads, never in the pass thread (a
command never holds up a pass, nor a pass a command beyond one look).

Imported by daemon/commands.py, daemon/passes.py, daemon/service.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from reconciler.engine import Pass
from reconciler.spec.loader import LoadResult

# A look, given the loaded files, the names to look at (None: all) and
# whether every image's watchers are listed.
Look = Callable[[LoadResult, frozenset[str] | None, bool], Pass]


@dataclass(frozen=True)
class Looked:
    """One look, and when it began (time.monotonic and the wall clock)."""

    loaded: LoadResult
    names: frozenset[str] | None
    all_watchers: bool
    began: float
    at: float
    result: Pass

    def serves(self, loaded: LoadResult, names: frozenset[str] | None, all_watchers: bool,
               asked: float) -> bool:
        return (self.began >= asked and self.loaded is loaded
                and (self.names is None or (names is not None and names <= self.names))
                and (self.all_watchers or not all_watchers))


class LiveView:
    def __init__(self, look: Look | None = None) -> None:
        self.loaded: LoadResult | None = None  # the files as the last pass loaded them
        self._look = look
        self._one = threading.Lock()  # one look at a time
        self._last: Looked | None = None

    def update(self, loaded: LoadResult) -> None:
        self.loaded = loaded

    def look(self, loaded: LoadResult, names: Collection[str] | None, all_watchers: bool,
             asked: float, wait: float) -> Looked | None:
        """A look at ``names`` begun at or after ``asked`` (time.monotonic);
        None when the look before it did not end within ``wait`` seconds."""
        want = None if names is None else frozenset(names)
        if not self._one.acquire(timeout=max(0.0, wait)):
            return None
        try:
            last = self._last
            if last is not None and last.serves(loaded, want, all_watchers, asked):
                return last  # begun after the question: as fresh as a look of its own
            assert self._look is not None
            began, at = time.monotonic(), time.time()
            looked = Looked(loaded, want, all_watchers, began, at,
                            self._look(loaded, want, all_watchers))
            self._last = looked
            return looked
        finally:
            self._one.release()
