"""One actor per stateDir: the daemon, or one command-line apply, never both.

Apart from the engine, so that a cold command takes the lock (and begins
its Ceph connect) before it imports the planner and the drivers.

Imported by engine/, engine/orphans.py, engine/release.py; ``flock_within``
by drivers/mountbusy.py and drivers/nbdhelper.py.
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


@contextlib.contextmanager
def flock_within(path: Path | str, wait: float, poll: float = 0.02) -> Iterator[bool]:
    """A node-wide lock file (created 0600, never through a symlink), held
    for the body: True once had, False if not had within ``wait`` s or the
    file cannot be opened (the caller decides what "not now" means). The
    lock goes with the descriptor."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        yield False
        return
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(poll)
        yield True
    finally:
        os.close(fd)
