"""``release --all``'s last resort: FUSE connections of ours that do not answer.

A volume whose release ran into a deadline (a command killed at its step
timeout, or the chains stopped at the overall deadline) may sit on an
rbd-fuse helper that no longer answers: fenced by a takeover, its cluster
gone. Everything waiting on it waits in the kernel for ever, this process
included (a thread that read the device cannot finish exiting), so the
shutdown would never end. Such a connection, when it has requests still
waiting for an answer, is ended (drivers/fuseforce.py): what it held could
not reach Ceph anyway. A connection with nothing waiting is left alone, as
is every volume whose release did not run into a deadline (a busy mount is
not a dead helper).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from reconciler.apply.outcomes import VolumeOutcome
from reconciler.drivers import fuseforce
from reconciler.drivers.fusemapper import FuseMapper
from reconciler.drivers.run import Runner
from reconciler.spec.config import Config
from reconciler.spec.model import Volume

log = logging.getLogger("reconciler.shutdown")

Image = tuple[str, str]


def stuck_threads(task_dir: Path = Path("/proc/self/task")) -> list[int]:
    """Our threads in uninterruptible sleep (D), each waiting on something
    that has not answered (a read of a device above a dead helper); one
    whose wait outlasts our exit holds the process, whatever it calls."""
    out = []
    for stat in task_dir.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if text[text.rindex(")") + 2:][:1] == "D":
            out.append(int(stat.parent.name))
    return out


def ran_into_deadline(outcomes: Iterable[VolumeOutcome], volumes: dict[str, Volume],
                      step_timeout: float, stalled: frozenset[str] = frozenset()) -> set[Image]:
    """Images whose chain was stopped at the deadline, or failed in a step that
    lasted a whole command deadline (a command killed at its step timeout), or
    failed at all while its device's I/O does not complete (``stalled``, by
    volume name: an umount refused as busy by a writer stuck in D state on
    that device fails at once, long before any deadline)."""
    out = set()
    for o in outcomes:
        vol = volumes.get(o.name)
        if vol is None:
            continue
        if o.status == "aborted" or any(s.status == "failed" and (
                s.seconds >= step_timeout or o.name in stalled) for s in o.steps):
            out.add((vol.image.pool, vol.image.name))
    return out


def unwedge(config: Config, images: set[Image] | None,
            budget: float = fuseforce.UNMOUNT_TIMEOUT_S) -> list[str]:
    """End the connections of the FUSE mounts of ``images`` (None: of every
    image) that have requests waiting, and kill their helpers; also of every
    such mount while a thread of ours is stuck in the kernel (the process
    could not end otherwise). The mounts stay: a release unmounts them in
    order (a lazy unmount under the loop device and the filesystem on it
    would hide those from every later look). Each command gets at most
    ``budget`` s (the deadline's). One line per mount forced."""
    if stuck_threads():
        images = None
    if (images is not None and not images) or budget <= 0:
        return []  # nothing ran into a deadline, nothing is stuck: nothing to touch
    runner = Runner(timeout=min(fuseforce.UNMOUNT_TIMEOUT_S, budget))  # not the halted one
    fuse = FuseMapper(config.ceph, config.state_dir / "fuse", runner)
    lines = []
    for m in fuse.list():
        if m.fuse_mount is None or (images is not None and (m.pool, m.image) not in images):
            continue
        forced = fuse.force_off(m.fuse_mount, runner, only_if_waiting=True, unmount=False)
        if forced is not None:
            line = f"{m.pool}/{m.image}: its rbd-fuse helper does not answer: {forced.describe()}"
            log.warning("forced: %s", line)
            lines.append(line)
    return lines
