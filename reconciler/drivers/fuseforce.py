"""Ending a FUSE connection of ours that does not answer.

An rbd-fuse helper that stops answering (its client fenced by a takeover,
its cluster gone, the process stopped) leaves every request to its mount
waiting in the kernel, uninterruptibly: ``umount`` (SIGKILLed at its
deadline, it stays in D state), a read of the loop device above it, even the
exit of a process one of whose threads read that device (the exit waits for
the read to end). No kill of a command ends that; ending the connection does:
its pending requests fail at once and their waiters go on.

So, for a mount that is provably ours (the caller checks: ``fuse.rbd-fuse``
under ``stateDir/fuse``): abort its connection through fusectl
(``/sys/fs/fuse/connections/N/abort``, N its device number; fusectl is
mounted there if it is not, and unmounted again after), kill its helper (a
process found by its command line, signalled through a pidfd: a recycled pid
is never hit), then unmount it, lazily if it is still busy (a loop device
still holds its file). I/O in flight to it fails: it could not reach Ceph.

Imported by drivers/fusemapper.py; engine/unwedge.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from reconciler.drivers.run import Aborted, CommandError, Runner
from reconciler.facts.observed import Mount, top_mounts
from reconciler.facts.parsers import parse_mountinfo

CONNECTIONS = Path("/sys/fs/fuse/connections")
FUSECTL = "fusectl"
KILL_WAIT_S = 2.0  # a SIGKILLed helper is gone this soon (it is in no D state of its own)
SETTLE_S = 2.0  # an umount killed in D state finishes once the connection is aborted
UNMOUNT_TIMEOUT_S = 10.0  # a command of the last resort (a forced umount): at most this long


def connection_id(mount: Mount) -> int:
    """fusectl names a connection by its superblock's device number, the
    kernel's dev_t (major << 20 | minor): the minor for FUSE's anonymous devices."""
    return (mount.major << 20) | mount.minor


def _mounts() -> tuple[Mount, ...]:
    return parse_mountinfo(Path("/proc/self/mountinfo").read_text())


_CONTROL_LOCK = threading.Lock()
_control_users = 0  # threads inside control() now (chains force in parallel)
_control_made: Mount | None = None  # the fusectl mount we made, while it has users
_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def control(at: Path = CONNECTIONS) -> Iterator[Path | None]:
    """fusectl at ``at``: there already (systemd mounts it), or mounted now
    and unmounted when the last thread of ours using it is done (only that
    mount, only if still on top). None when it cannot be had: a killed
    helper ends its connection all the same. System calls, not mount(8):
    neither blocks, and no command is started when time is short."""
    global _control_users, _control_made
    with _CONTROL_LOCK:
        if _control_users == 0 and not _mounted_at(at):
            _control_made = None
            if _libc.mount(FUSECTL.encode(), os.fsencode(at), FUSECTL.encode(), 0, None) == 0:
                _control_made = top_mounts(_mounts()).get(str(at))
        usable = _mounted_at(at)
        _control_users += 1
    try:
        yield at if usable else None
    finally:
        with _CONTROL_LOCK:
            _control_users -= 1
            made, top = _control_made, top_mounts(_mounts()).get(str(at))
            if _control_users == 0 and made is not None:
                _control_made = None
                if made.fs_type == FUSECTL and top == made:
                    _libc.umount2(os.fsencode(at), 0)


def _mounted_at(at: Path) -> bool:
    top = top_mounts(_mounts()).get(str(at))
    return top is not None and top.fs_type == FUSECTL


def waiting(ctl: Path, conn: int) -> int | None:
    """Requests of the connection not answered yet (None: no such connection)."""
    try:
        return int((ctl / str(conn) / "waiting").read_text().strip() or "0")
    except (OSError, ValueError):
        return None


def abort(ctl: Path, conn: int) -> bool:
    """Fail every pending and future request of the connection (never blocks)."""
    try:
        fd = os.open(ctl / str(conn) / "abort", os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.write(fd, b"1")
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def kill_verified(pid: int, is_ours: Callable[[int], bool], wait: float = KILL_WAIT_S) -> bool:
    """SIGKILL ``pid`` through a pidfd, after checking it is ours (the check
    runs once the pidfd holds the process: a pid recycled before that fails
    it, one recycled after is not the process the pidfd signals). True once
    it is gone, within ``wait``."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if not is_ours(pid):
            return False
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN)  # readable once it has exited
        return bool(poller.poll(int(wait * 1000)))
    finally:
        os.close(fd)


class ForcedOff(Exception):
    """A FUSE mount did not answer and was forced off (or could not be):
    the step that met it fails, saying what was done."""


@dataclass(frozen=True)
class Forced:
    """What forcing off one FUSE mount did."""

    mount_point: str
    connection: int
    aborted: bool
    killed: tuple[int, ...]
    left: str | None  # None: unmounted; else why it is still mounted

    def describe(self) -> str:
        done = [f"aborted FUSE connection {self.connection}" if self.aborted else
                f"could not abort FUSE connection {self.connection}"]
        if self.killed:
            done.append("killed its rbd-fuse helper (pid "
                        + ", ".join(map(str, self.killed)) + ")")
        done.append(self.left or "unmounted it")
        return ", ".join(done) + "; I/O in flight to it failed"


def top_mount(mount_point: str) -> Mount | None:
    """The visible mount at ``mount_point``, if any."""
    return top_mounts(_mounts()).get(mount_point)


def force_off(mount: Mount, helpers: Iterable[int], is_ours: Callable[[int], bool],
              runner: Runner, *, only_if_waiting: bool = False,
              unmount: bool = True) -> Forced | None:
    """Abort ``mount``'s connection, kill its helpers (each checked by
    ``is_ours``), and unmount it: plainly, else lazily (``unmount``).
    ``only_if_waiting``: None, doing nothing, unless requests of that
    connection are waiting for an answer. ``runner``'s timeout bounds each
    command (and the wait for a kill); it must not be one a deadline has
    halted (its commands would be refused)."""
    conn = connection_id(mount)
    with control() as ctl:
        pending = waiting(ctl, conn) if ctl is not None else None
        if only_if_waiting and not pending:
            return None
        aborted = ctl is not None and pending is not None and abort(ctl, conn)
    wait = min(KILL_WAIT_S, runner.timeout)
    killed = tuple(pid for pid in sorted(set(helpers)) if kill_verified(pid, is_ours, wait))
    left = _unmount(mount, runner) if unmount else "left it mounted"
    return Forced(mount.mount_point, conn, aborted, killed, left)


def _still_there(mount: Mount) -> bool:
    return any(m.mount_id == mount.mount_id for m in _mounts())


def _unmount(mount: Mount, runner: Runner) -> str | None:
    """None once ``mount`` is gone. A killed ``umount`` that was waiting on the
    connection finishes by itself once it is aborted: give it a moment first."""
    end = time.monotonic() + SETTLE_S
    while _still_there(mount) and time.monotonic() < end:
        time.sleep(0.05)
    errors = []
    for flags, done in (((), None), (("-l",), "detached it lazily (umount -l)")):
        if not _still_there(mount):
            return None
        top = top_mounts(_mounts()).get(mount.mount_point)
        if top is None or top.mount_id != mount.mount_id:
            return "left it mounted: another mount is on top of it"
        try:
            runner.run(["umount", *flags, "--", mount.mount_point])
        except (CommandError, Aborted) as exc:
            errors.append(str(exc))
        if not _still_there(mount):
            return done
    return "still mounted (" + "; ".join(errors) + ")"
