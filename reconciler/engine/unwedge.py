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
not a dead helper; which ones did: plan/release.py ``ran_into_deadline``).

Imported by engine/release.py only (which also ends these connections for
the CLI when the release does not return by its deadline).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from reconciler.drivers import fuseforce
from reconciler.drivers.fusemapper import FuseMapper
from reconciler.drivers.run import Runner
from reconciler.plan.release import Image
from reconciler.spec.config import CephConfig

log = logging.getLogger("reconciler.shutdown")


@dataclass(frozen=True)
class FuseMounts:
    """All the last resort needs of the config: where our rbd-fuse mounts
    are (stateDir/fuse) and the Ceph settings their mapper is built with."""

    ceph: CephConfig
    root: Path


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


def unwedge(mounts: FuseMounts, images: set[Image] | None,
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
    fuse = FuseMapper(mounts.ceph, mounts.root, runner)
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
