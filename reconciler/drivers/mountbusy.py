"""Whether the kernel counts a user of a mount, asked without unmounting it.

``umount2(path, MNT_EXPIRE)`` refuses with EBUSY while anything holds the
mount (an open or mapped file, a working or root directory, a mount inside
it: the kernel's own count, whatever namespace or privilege the user has),
and otherwise only marks it expired (EAGAIN): a second such call would
unmount it. The mark is cleared at once by a lookup of the path (any
``mntput`` clears it), so one call here never unmounts anything.

Two such questions at once could interleave (A looks up, B looks up, A
marks, B finds the mark and unmounts): ours (the daemon's, a CLI's) are
asked one at a time, under a lock file (LOCK_PATH); one not had within
LOCK_WAIT_S is no answer.

It answers for the processes /proc does not show us (a daemon without
CAP_SYS_PTRACE cannot read the descriptors of a process with more
capabilities than its own). Imported by observe/deadfuse.py and
observe/leftovers.py only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os

from reconciler.state.lock import flock_within

MNT_EXPIRE = 4
UMOUNT_NOFOLLOW = 8  # a symlink at the path is never followed (safety rule 8)
_libc = ctypes.CDLL(None, use_errno=True)
LOCK_PATH = "/run/rbd-reconciler-mountbusy.lock"  # root's /run: no other user's directory
LOCK_WAIT_S = 5.0


def busy(path: str) -> bool | None:
    """True: the top mount at ``path`` is in use (or a mount sits inside
    it); False: nothing holds it; None: the kernel did not say (no
    privilege, not a mount point, anything else)."""
    with _one_at_a_time() as held:
        if not held:
            return None
        # A lookup first clears a mark left by anyone before (else this call
        # would be the second one, and unmount it); one after clears ours.
        try:
            _touch(path)
        except OSError:
            return None
        rc = _libc.umount2(os.fsencode(path), MNT_EXPIRE | UMOUNT_NOFOLLOW)
        err = ctypes.get_errno() if rc != 0 else 0
        with contextlib.suppress(OSError):
            _touch(path)
    if rc == 0:  # marked again in between by someone else's probe: unmounted, so unused
        return False
    if err == errno.EBUSY:
        return True
    if err == errno.EAGAIN:
        return False
    return None


def _touch(path: str) -> None:
    """A lookup of the mount and its release (``mntput`` clears an expiry mark)."""
    os.close(os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC))


def _one_at_a_time() -> contextlib.AbstractContextManager[bool]:
    """The lock that keeps our questions apart; False if not had in time."""
    return flock_within(LOCK_PATH, LOCK_WAIT_S)
