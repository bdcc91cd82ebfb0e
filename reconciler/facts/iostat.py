"""A block device's I/O counters, as ``/sys/dev/block/MAJ:MIN/stat`` gives
them (Documentation/block/stat.rst). Pure; no I/O.

Reading that file never touches the device: the kernel adds up its own
counters. So it answers even while every request to the device hangs (a
Ceph cluster out of reach), which is when it matters: requests in flight and
a completion count that does not move are I/O that does not complete.
"""

from __future__ import annotations

from dataclasses import dataclass

# Field indexes (0-based) in the stat line.
_READS, _WRITES, _IN_FLIGHT, _DISCARDS, _FLUSHES = 0, 4, 8, 11, 15


@dataclass(frozen=True)
class IoCounters:
    completed: int  # requests completed, every direction (read, write, discard, flush)
    in_flight: int  # requests issued to the driver and not completed


def parse_stat(text: str) -> IoCounters | None:
    """None: not a stat line (fewer than the 11 fields every kernel since 2.6 writes)."""
    try:
        fields = [int(x) for x in text.split()]
    except ValueError:
        return None
    if len(fields) < 11:
        return None
    done = fields[_READS] + fields[_WRITES]
    for i in (_DISCARDS, _FLUSHES):  # 4.18 and 5.5 added these
        if len(fields) > i:
            done += fields[i]
    return IoCounters(done, fields[_IN_FLIGHT])
