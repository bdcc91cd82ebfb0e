"""Is a mapped device's I/O completing? Answered from sysfs, never the device.

A device whose requests do not complete (a Ceph out of reach: krbd and
rbd-nbd wait, by default, for as long as it takes) hangs whatever touches
it: a probe, a ``blkid``, an unmount, an unmap. Its counters in
``/sys/dev/block/MAJ:MIN/stat`` still answer, so they are sampled and
compared: requests in flight and a completion count that has not moved for
a while is I/O that does not complete (a flush, which that count leaves
out, from blk-mq's debugfs: facts/iostat.py). The daemon samples every mapped
device of its volumes every ``events.ioPollSeconds`` and keeps the history;
a CLI samples twice, ``WINDOW_S`` apart, where something is in flight.

Imported by daemon/events.py; observe/node.py.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from reconciler.facts.iostat import IoCounters, parse_busy, parse_stat
from reconciler.facts.observed import IoStall

# Watched at least this long before "nothing completed" means anything: a
# CLI's two samples are this far apart.
WINDOW_S = 1.0

Reader = Callable[[str], tuple[int, IoCounters] | None]


def read_counters(device: str, sys_root: str = "/sys") -> tuple[int, IoCounters] | None:
    """(rdev, counters) of a device node; None when it is gone or unreadable.
    Nothing in flight by the count: blk-mq's debugfs, where it is mounted
    (systemd does), may still list a flush the driver holds."""
    try:
        rdev = os.stat(device).st_rdev
        block = f"{sys_root}/dev/block/{os.major(rdev)}:{os.minor(rdev)}"
        with open(f"{block}/stat") as f:
            counters = parse_stat(f.read())
    except OSError:
        return None
    if counters is None:
        return None
    if counters.in_flight == 0:
        held = _driver_busy(f"{sys_root}/kernel/debug/block/"
                            f"{os.path.basename(os.path.realpath(block))}")
        counters = IoCounters(counters.completed, held)
    return rdev, counters


def _driver_busy(debugfs: str) -> int:
    """Requests blk-mq's driver holds (0: none, or no debugfs to tell)."""
    held = 0
    with contextlib.suppress(OSError):
        for hctx in os.listdir(debugfs):
            if hctx.startswith("hctx"):
                with contextlib.suppress(OSError), open(f"{debugfs}/{hctx}/busy") as f:
                    held += parse_busy(f.read())
    return held


@dataclass
class _Entry:
    rdev: int
    completed: int
    in_flight: int
    watched: float  # monotonic: the first sample of this device
    progress: float  # monotonic: the count last moved, or nothing was in flight
    progress_wall: float
    completion_wall: float | None  # a completion was last seen (None: not yet)


class IoWatch:
    """Per device path, its last counters and when they last showed progress.
    Thread-safe: the daemon's sampler and its passes share one."""

    def __init__(self, stall_seconds: float, read: Reader = read_counters,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.stall_seconds = stall_seconds
        self._read, self._clock, self._wall = read, clock, wall
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        # wait_needed: until what is in flight has been quiet for the window
        # (not only watched for it): a command's 1 s look, on a long record.
        self._quiet_for_window = False

    def as_a_command_judges(self) -> IoWatch:
        """The same record (shared, not copied), judged as a command alone
        judges a stall: requests in flight and none completed for ``WINDOW_S``.
        The daemon's answers to status, plan and explain use it, so they say
        what the command would say alone; its own passes keep
        ``stall_seconds`` before they hold a volume for it."""
        judged = IoWatch(min(self.stall_seconds, WINDOW_S), self._read, self._clock, self._wall)
        judged._lock, judged._entries = self._lock, self._entries
        judged._quiet_for_window = True
        return judged

    def sample(self, devices: Iterable[str], forget: bool = False) -> None:
        """Read each device's counters once; ``forget``: drop the devices not
        named (the daemon's sampler names every mapped device of its volumes)."""
        devices = set(devices)
        read = {d: self._read(d) for d in devices}
        now, wall = self._clock(), self._wall()
        with self._lock:
            if forget:
                for dev in [d for d in self._entries if d not in devices]:
                    del self._entries[dev]
            for dev, got in read.items():
                if got is None:
                    self._entries.pop(dev, None)
                    continue
                rdev, c = got
                e = self._entries.get(dev)
                if e is None or e.rdev != rdev:  # new, or the number was reused
                    self._entries[dev] = _Entry(rdev, c.completed, c.in_flight, now, now, wall,
                                                None)
                    continue
                if c.completed != e.completed:
                    e.completion_wall = wall
                if c.completed != e.completed or c.in_flight == 0:
                    e.progress, e.progress_wall = now, wall
                e.completed, e.in_flight = c.completed, c.in_flight

    def wait_needed(self, devices: Iterable[str], window: float = WINDOW_S) -> float:
        """Seconds until every device of ``devices`` with I/O in flight has
        been watched for ``window``: then a second sample says whether its
        I/O completes. 0: nothing to wait for."""
        now = self._clock()
        with self._lock:
            entries = [self._entries[d] for d in devices if d in self._entries]
            return max([0.0] + [window - (now - (max(e.watched, e.progress)
                                                 if self._quiet_for_window else e.watched))
                                for e in entries if e.in_flight])

    def stall(self, device: str, window: float = WINDOW_S) -> IoStall | None:
        """Stalled: requests in flight and none completed for ``stall_seconds``,
        or for all the time it was watched (at least ``window``)."""
        now = self._clock()
        with self._lock:
            e = self._entries.get(device)
            if e is None or not e.in_flight:
                return None
            quiet, watched = now - e.progress, now - e.watched
            if watched < window or quiet < min(self.stall_seconds, watched):
                return None
            return IoStall(device, e.in_flight, quiet, e.progress_wall, e.completion_wall)

    def stalled(self, devices: Iterable[str], window: float = WINDOW_S) -> dict[str, IoStall]:
        return {d: s for d in devices if (s := self.stall(d, window)) is not None}
