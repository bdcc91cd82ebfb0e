"""One actor per stateDir: the daemon, or one command-line apply, never both.

Apart from the engine, so that a cold command takes the lock (and begins
its Ceph connect) before it imports the planner and the drivers.

Imported by engine/, engine/orphans.py, engine/release.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from reconciler.state.files import open_lock


class Busy(Exception):
    pass


@contextlib.contextmanager
def locked(state_dir: Path, wait: bool = False) -> Iterator[None]:
    """Hold ``state_dir``'s lock; Busy at once when another holds it (unless ``wait``)."""
    fd = open_lock(state_dir / "lock")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise Busy(f"{state_dir} is in use by another rbd-reconciler "
                           "(the daemon, or another apply)") from None
            raise
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked_within(state_dir: Path, timeout: float) -> Iterator[None]:
    """``state_dir``'s lock, waiting up to ``timeout`` s for another holder
    still exiting (``release --all`` right after the daemon stopped)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with locked(state_dir):
                yield
                return
        except Busy:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
