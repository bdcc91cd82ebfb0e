"""A block device's I/O counters, as ``/sys/dev/block/MAJ:MIN/stat`` gives
them (Documentation/block/stat.rst). Pure; no I/O.

Reading that file never touches the device: the kernel adds up its own
counters. So it answers even while every request to the device hangs (a
Ceph cluster out of reach), which is when it matters: requests in flight and
a completion count that does not move are I/O that does not complete.

A flush is the exception: blk-mq issues it as a request of the queue's own,
which the in-flight count leaves out (measured on 6.1 with rbd-nbd, whose
librbd acknowledges writes from its cache: an fdatasync hung for the whole
partition while the count said 0). blk-mq's debugfs lists every request the
driver holds (``/sys/kernel/debug/block/NAME/hctx*/busy``), flushes too.

Imported by observe/iowatch.py.
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


def parse_busy(text: str) -> int:
    """Requests the driver holds, from one ``hctx*/busy`` file of blk-mq's
    debugfs (one line per request: ``ADDR {.op=FLUSH, ..., .state=in_flight, ...}``)."""
    return sum(".state=in_flight" in line for line in text.splitlines())
