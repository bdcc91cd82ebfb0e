"""fsfreeze around a snapshot, with a record that outlives a crash.

A filesystem frozen by a process that then dies stays frozen: every writer
on it hangs. So the freeze is recorded (stateDir/freezes.json) before it is
made and forgotten only after the thaw; the next pass thaws whatever is
recorded (a thaw of a filesystem that is not frozen is harmless).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .. import safepath
from ..registry import Registry

# <linux/fs.h>: _IOWR('X', 119, int) and _IOWR('X', 120, int)
FIFREEZE = 0xC0045877
FITHAW = 0xC0045878


class Freezes(Registry):
    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir / "freezes.json")


class WrongFilesystem(Exception):
    """The path no longer holds the filesystem the plan meant to freeze."""


def _ioctl(path: str, request: int, rdev: tuple[int, int] | None = None) -> None:
    # The mount point is opened without following symlinks (safety rule 8);
    # the ioctl needs a real descriptor, not an O_PATH one.
    fd = safepath.open_nofollow(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if rdev is not None and os.fstat(fd).st_dev != os.makedev(*rdev):
            # Unmounted since the plan: freezing what is there now (the root
            # filesystem, say) would hang the node.
            raise WrongFilesystem(f"{path} is no longer a mount of device "
                                  f"{rdev[0]}:{rdev[1]}; not freezing it")
        fcntl.ioctl(fd, request, 0)
    finally:
        os.close(fd)


def thaw(path: str, records: Freezes) -> bool:
    """Thaw ``path``; False when it was not frozen. Forgets the record."""
    try:
        _ioctl(path, FITHAW)
        thawed = True
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: not frozen
            raise
        thawed = False
    records.forget(path)
    return thawed


@contextlib.contextmanager
def frozen(path: str | None, records: Freezes, rdev: tuple[int, int] | None
           ) -> Iterator[None]:
    """Freeze ``path`` (None: nothing to freeze), which must be a mount of
    device ``rdev``, for the body; thawed on the way out whatever happens."""
    if path is None:
        yield
        return
    records.record(path, {"pid": os.getpid()})
    try:
        _ioctl(path, FIFREEZE, rdev)
    except BaseException:
        records.forget(path)
        raise
    try:
        yield
    finally:
        thaw(path, records)
