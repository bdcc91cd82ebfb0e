"""fsfreeze around a snapshot: bounded, one per device, and undone after a crash.

A filesystem frozen by a process that then dies stays frozen: every writer
on it hangs. So each freeze is recorded (stateDir/freezes.json) before it is
made and forgotten only after the thaw. A record names its owner (pid, the
process's start time, and a token per chain): ``thaw_recorded`` thaws what a
dead owner left behind from the record alone, before anything talks to Ceph
(a Ceph outage must not keep an application's writes hanging), and never
thaws a freeze a live chain still holds. A record carries the boot's id: one
of an earlier boot is forgotten, never thawed (the reboot thawed it, and its
device numbers may now be another filesystem's, or its pid another process's).

While held, a freeze is bounded: a watchdog thaws at the deadline even when
the snapshot call hangs (a monitor that does not answer). And one freeze per
device at a time: a second FIFREEZE fails with EBUSY, so chains (threads of
one apply, or the daemon and a CLI) take a per-device lock first.

Imported by apply/groups.py, apply/imagesteps.py, apply/runner.py;
daemon/commands.py, daemon/service.py; engine/frozen.py, engine/orphans.py,
engine/release.py; observe/node.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reconciler.drivers import procfs, safepath
from reconciler.drivers.bounded import Bounded, NoAnswer
from reconciler.drivers.reaper import reap_later
from reconciler.state import boot
from reconciler.state.files import open_lock
from reconciler.state.registry import FREEZES, Registry

log = logging.getLogger(__name__)

# <linux/fs.h>: _IOWR('X', 119, int) and _IOWR('X', 120, int)
FIFREEZE = 0xC0045877
FITHAW = 0xC0045878

DEFAULT_TIMEOUT_S = 5.0
# A thaw of a filesystem whose storage is gone (OSD down) waits in the kernel:
# never hold up the caller (the daemon's start-up) longer than this.
THAW_WAIT_S = 10.0
# One freeze or thaw child's deadline (the freeze's own, at most: a freeze
# whose write-back outlasts the hold would be thawed at once anyway).
IOCTL_TIMEOUT_S = 10.0
KILL_WAIT_S = 1.0  # after SIGKILL: gone, or stuck in the kernel
_LOCK_POLL_S = 0.02

# Tokens of the freezes this process holds right now: its other records are
# left over from chains that failed to thaw, and may be thawed.
_live: set[str] = set()
_live_guard = threading.Lock()
_THAWS = Bounded(max_running=4, name="thaw")


class Freezes(Registry):
    """The records. Written by more than one process (the daemon's chains, a
    CLI thawing what a dead run left): each update holds a file lock too, or
    one process's write would drop a record the other just made."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir / FREEZES)

    @contextlib.contextmanager
    def _across_processes(self) -> Iterator[None]:
        fd = open_lock(self.path.with_name("freezes.lock"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for one small write only
            yield
        finally:
            os.close(fd)

    def record(self, key: str, value: Any) -> None:
        with self._across_processes():
            super().record(key, value)

    def forget(self, key: str) -> None:
        with self._across_processes():
            super().forget(key)


class WrongFilesystem(Exception):
    """The path no longer holds the filesystem the plan meant to freeze."""


class Busy(Exception):
    """Another chain holds a freeze of this filesystem."""


class NotMounted(Exception):
    """The recorded filesystem is mounted nowhere: it cannot be thawed now."""


class TimedOut(OSError):
    """A freeze or thaw did not end in time; its child was killed and is gone
    (whether the ioctl got through before the kill is not known)."""


class StillRunning(TimedOut):
    """A freeze or thaw did not end in time and its child did not go when
    killed (stuck in the kernel): it may still complete."""

    def __init__(self, pid: int, start: int | None, timeout: float) -> None:
        super().__init__(errno.ETIMEDOUT, f"did not end within {timeout:g} s (the "
                         f"filesystem's storage does not answer); pid {pid} is stuck in "
                         "the kernel")
        self.pid, self.start = pid, start


@dataclass(frozen=True)
class Record:
    key: str
    path: str
    dev: tuple[int, int] | None  # None: a record written before devices were recorded
    pid: int | None
    start: int | None  # the owner's start time (/proc/PID/stat field 22)
    earlier_boot: bool = False  # made before the last reboot: nothing is frozen
    # A freeze's child (pid, start) stuck in the kernel: it may still freeze
    # the filesystem, so nothing thaws (and forgets) this record before it is gone.
    child: tuple[int, int | None] | None = None

    @classmethod
    def parse(cls, key: str, value: Any, boot_now: str | None = None) -> Record:
        v = value if isinstance(value, dict) else {}
        dev = v.get("dev")
        ok_dev = isinstance(dev, list) and len(dev) == 2 and all(isinstance(x, int) for x in dev)
        pid, start = v.get("pid"), v.get("start")
        child = v.get("child")
        ok_child = (isinstance(child, list) and len(child) == 2 and isinstance(child[0], int)
                    and (child[1] is None or isinstance(child[1], int)))
        return cls(key, str(v.get("path", key)), (dev[0], dev[1]) if ok_dev else None,
                   pid if isinstance(pid, int) else None,
                   start if isinstance(start, int) else None,
                   boot.of_another_boot(v.get("boot"), boot_now),
                   (child[0], child[1]) if ok_child else None)

    @property
    def owner(self) -> str:
        return f"pid {self.pid}" if self.pid is not None else "an unknown process"

    def owner_alive(self) -> bool:
        if self.child is not None and _start_time(self.child[0]) is not None \
                and self.child[1] in (None, _start_time(self.child[0])):
            return True  # its freeze may still land: thawing now could come first
        if self.pid is None:
            return False
        if self.pid == os.getpid():
            if self.start is None or self.start != _start_time(self.pid):
                return False  # another process, since gone, had our pid
            with _live_guard:
                return self.key in _live
        started = _start_time(self.pid)
        # Without a recorded start time (an old record) a live pid is trusted.
        return started is not None and (self.start is None or started == self.start)


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): a reused pid differs."""
    try:
        return int(procfs.stat_fields(f"/proc/{pid}/stat")[1][19])
    except (OSError, ValueError, IndexError):
        return None


def _ioctl(path: str, request: int, rdev: tuple[int, int] | None = None,
           timeout: float = IOCTL_TIMEOUT_S,
           on_child: Callable[[int, int | None], None] | None = None) -> None:
    # The mount point is opened without following symlinks (safety rule 8);
    # the ioctl needs a real descriptor, not an O_PATH one.
    fd = safepath.open_nofollow(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if rdev is not None and os.fstat(fd).st_dev != os.makedev(*rdev):
            # Unmounted since: freezing (or thawing) what is there now (the
            # root filesystem, say) could hang the node.
            raise WrongFilesystem(f"{path} is no longer a mount of device "
                                  f"{rdev[0]}:{rdev[1]}")
        _in_child(fd, request, timeout, on_child)
    finally:
        os.close(fd)


def _in_child(fd: int, request: int, timeout: float,
              on_child: Callable[[int, int | None], None] | None = None) -> None:
    """FIFREEZE or FITHAW of the filesystem open on ``fd``, made by a child
    (util-linux's fsfreeze on ``/proc/self/fd/N``: the directory we opened
    and checked, not a path looked up again). A freeze writes back every
    dirty page first and a thaw may write the superblock: on storage that
    does not answer either sleeps in the kernel (D state, uninterruptible),
    and in a thread of ours it would keep the daemon from exiting (issue 41,
    item 6). The child is killed at ``timeout``; one that does not go (stuck
    in the kernel) is left to the reaper and raised as StillRunning: it may
    still freeze the filesystem when the storage answers. ``on_child``:
    told the child's pid and start time as soon as it runs (a freeze's
    record names it from then on: its owner may die while it is stuck)."""
    argv = ["fsfreeze", "--freeze" if request == FIFREEZE else "--unfreeze", "--",
            f"/proc/self/fd/{fd}"]
    # C locale: its error is our errno's strerror (it says nothing else).
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, pass_fds=(fd,), start_new_session=True,
                            env={"PATH": os.environ.get("PATH", os.defpath), "LC_ALL": "C"})
    try:
        if on_child is not None:
            on_child(proc.pid, _start_time(proc.pid))
    except BaseException:
        # Not recorded: it must not go on. Killed at once, it never got far.
        proc.kill()
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            reap_later(proc)
            raise StillRunning(proc.pid, _start_time(proc.pid), 0) from None
        raise
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        start = _start_time(proc.pid)
        proc.kill()
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            if proc.stderr is not None:
                proc.stderr.close()
            reap_later(proc)
            raise StillRunning(proc.pid, start, timeout) from None
        raise TimedOut(errno.ETIMEDOUT, f"{argv[1][2:]} did not end within {timeout:g} s "
                       "(the filesystem's storage does not answer); killed") from None
    if proc.returncode == 0:
        return
    text = err.decode("utf-8", "replace").strip()
    for code in (errno.EBUSY, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES):
        if text.endswith(os.strerror(code)):
            raise OSError(code, os.strerror(code))
    raise OSError(errno.EIO, text or f"fsfreeze exited {proc.returncode}")


def _dev_of(path: str) -> tuple[int, int]:
    fd = safepath.open_nofollow(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return os.major(st.st_dev), os.minor(st.st_dev)


def _thaw_device(path: str, rdev: tuple[int, int] | None) -> bool:
    """FITHAW the filesystem of device ``rdev``: at ``path`` while it is still
    mounted there, else at any other mount of it (the superblock is one).
    False: it was not frozen. NotMounted: it is mounted nowhere."""
    candidates = [path]
    if rdev is not None:
        mounts = procfs.mounts()
        candidates += [m.mount_point for m in mounts
                       if (m.major, m.minor) == rdev and m.mount_point != path]
    for where in candidates:
        try:
            _ioctl(where, FITHAW, rdev)
            return True
        except (WrongFilesystem, FileNotFoundError, NotADirectoryError, safepath.UnsafePath):
            continue
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # not frozen
                return False
            raise
    raise NotMounted(f"device {rdev[0]}:{rdev[1]} is not mounted anywhere" if rdev
                     else f"{path} is not accessible")


# -- what a dead owner left ----------------------------------------------------
def recorded(state_dir: Path) -> list[Record]:
    now = boot.boot_id()
    return [Record.parse(k, v, now) for k, v in Freezes(state_dir).all().items()]


def left_frozen(state_dir: Path) -> list[Record]:
    """Recorded freezes of this boot whose owner is gone (no Ceph, no ioctl)."""
    return [r for r in recorded(state_dir) if not r.earlier_boot and not r.owner_alive()]


def thaw_recorded(state_dir: Path, wait: float = THAW_WAIT_S) -> list[str]:
    """Thaw every freeze a dead owner left behind and forget its record: from
    the record alone, so it runs before anything connects to Ceph. Freezes a
    live chain holds (the daemon's, while a CLI runs) are left to it.
    Returns one line per record handled, for the operator."""
    records = Freezes(state_dir)
    out = []
    for rec in recorded(state_dir):
        if rec.earlier_boot:
            out.append(f"{rec.path}: recorded frozen by {rec.owner} in an earlier boot, which "
                       "thawed it; record dropped")
            try:
                records.forget(rec.key)
            except OSError as exc:
                out[-1] += f" (not yet: {exc})"
    deadline = time.monotonic() + wait  # for all of them: stuck thaws do not add up
    for rec in left_frozen(state_dir):
        try:
            task = _THAWS.submit(rec.dev or rec.path, lambda r=rec: _thaw_device(r.path, r.dev))
            thawed = _THAWS.wait(task, wait, deadline)
        except NotMounted as exc:
            if rec.dev is not None and Path(f"/sys/dev/block/{rec.dev[0]}:{rec.dev[1]}"
                                            ).exists():
                out.append(f"{rec.path}: left frozen by {rec.owner}, but {exc}; kept to "
                           "thaw once it is mounted again")
                continue
            out.append(f"{rec.path}: left frozen by {rec.owner}; its device is gone")
        except NoAnswer as exc:
            out.append(f"{rec.path}: left frozen by {rec.owner}; the thaw did not complete "
                       f"({exc}: its storage does not answer); kept to retry")
            continue
        except OSError as exc:
            out.append(f"{rec.path}: left frozen by {rec.owner}; the thaw failed: {exc}")
            continue
        else:
            out.append(f"{rec.path}: thawed (left frozen by {rec.owner}, which is gone)"
                       if thawed else f"{rec.path}: was not frozen (record of {rec.owner})")
        try:
            records.forget(rec.key)
        except OSError as exc:  # a full stateDir: the next run finds it not frozen
            out[-1] += f"; its record stays ({exc})"
    return out


def thaw_left(state_dir: Path, path: str) -> bool | None:
    """The planned Thaw step: thaw what a dead owner left at ``path``. None:
    a live chain holds it (a snapshot in progress); False: was not frozen."""
    recs = [r for r in left_frozen(state_dir) if r.path == path]
    if not recs:
        # Already handled (thaw_recorded at start-up), or a live chain's:
        # without a record, what is at ``path`` now is not ours to thaw.
        held = any(r.path == path and not r.earlier_boot for r in recorded(state_dir))
        return None if held else False
    thawed = False
    for rec in recs:
        thawed = _thaw_device(rec.path, rec.dev) or thawed
        Freezes(state_dir).forget(rec.key)
    return thawed


# -- one freeze, held ----------------------------------------------------------
@contextlib.contextmanager
def device_lock(state_dir: Path, rdev: tuple[int, int], wait: float) -> Iterator[None]:
    """One freeze per device at a time, across threads and processes (each
    open has its own flock). Waits up to ``wait`` s, then raises Busy."""
    fd = open_lock(state_dir / "locks" / f"freeze-{rdev[0]}:{rdev[1]}")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for_lock(fd, rdev, wait)
        yield
    finally:
        os.close(fd)


def _wait_for_lock(fd: int, rdev: tuple[int, int], wait: float) -> None:
    """Another chain freezes this device now: its freeze ends within its own
    deadline, so wait as long, then give up."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise Busy(f"busy: another snapshot of the filesystem on {rdev[0]}:{rdev[1]} "
                           f"is in progress (waited {wait:g} s)") from None
            time.sleep(_LOCK_POLL_S)


class Hold:
    """A freeze in place: thawed once, by the chain or by the watchdog at the
    deadline, whichever comes first."""

    def __init__(self, path: str, rdev: tuple[int, int], records: Freezes,
                 timeout: float) -> None:
        self.path, self.rdev, self.records, self.timeout = path, rdev, records, timeout
        self.token = f"{os.getpid()}-{secrets.token_hex(8)}"
        self.expired = False  # the watchdog thawed it
        self._thawed = False
        self._lock = threading.Lock()
        self._done = threading.Event()

    def freeze(self) -> None:
        with _live_guard:
            _live.add(self.token)
        pid = os.getpid()
        record = {"path": self.path, "dev": list(self.rdev), "pid": pid,
                  "start": _start_time(pid), "boot": boot.boot_id()}
        self.records.record(self.token, record)

        def child_runs(pid: int, start: int | None) -> None:
            # Named before it can freeze anything: if this process dies while
            # the child is stuck in the kernel, the record is not a dead
            # owner's (thawed as "not frozen", forgotten) while its freeze
            # may still land.
            self.records.record(self.token, {**record, "child": [pid, start]})

        try:
            _ioctl(self.path, FIFREEZE, self.rdev, self.timeout, child_runs)
        except StillRunning as exc:
            # Its freeze may still land once the storage answers: the record
            # stays, naming the child, and the first pass after the child is
            # gone thaws it (thaw_left, thaw_recorded).
            self._forget_live()
            self.records.record(self.token, {**record, "child": [exc.pid, exc.start]})
            raise
        except TimedOut:
            self._forget_live()
            self._thaw_after_timeout()
            raise
        except BaseException:
            self.records.forget(self.token)
            self._forget_live()
            raise
        threading.Thread(target=self._watchdog, daemon=True,
                         name=f"freeze-watchdog:{self.path}").start()

    def _thaw_after_timeout(self) -> None:
        """The freeze's child was killed in time: whether its ioctl got
        through is not known, so thaw (EINVAL: it did not). One that cannot
        be thawed now keeps its record, with no live owner: the next pass
        thaws it."""
        try:
            _thaw_device(self.path, self.rdev)
        except (OSError, NotMounted) as exc:
            log.warning("%s: a freeze that timed out may hold: %s; the next pass thaws it",
                        self.path, exc)
            return
        self.records.forget(self.token)

    def _watchdog(self) -> None:
        if self._done.wait(self.timeout):
            return
        log.warning("%s frozen for %g s: thawing it now", self.path, self.timeout)
        try:
            self.thaw(expired=True)
        except Exception as exc:  # the chain's own thaw tries again
            log.error("%s: the watchdog's thaw failed: %s", self.path, exc)

    def thaw(self, expired: bool = False) -> None:
        with self._lock:
            if self._thawed:
                return
            self.expired = self.expired or expired
            try:
                _thaw_device(self.path, self.rdev)
            except NotMounted as exc:
                # Unmounted while frozen: the record stays (its owner is gone
                # once this chain ends), so the next pass thaws it if it is
                # mounted again.
                log.warning("%s: cannot thaw: %s", self.path, exc)
                self._thawed = True
                return
            self._thawed = True
            self.records.forget(self.token)

    def release(self) -> None:
        self._done.set()
        try:
            self.thaw()
        finally:
            self._forget_live()

    def _forget_live(self) -> None:
        with _live_guard:
            _live.discard(self.token)


@contextlib.contextmanager
def frozen(path: str | None, state_dir: Path, rdev: tuple[int, int] | None,
           timeout: float = DEFAULT_TIMEOUT_S) -> Iterator[Hold | None]:
    """Freeze ``path`` (None: nothing to freeze), which must be a mount of
    device ``rdev``, for the body; thawed on the way out whatever happens,
    and by a watchdog after ``timeout`` s even while the body hangs (then
    ``Hold.expired`` is set)."""
    if path is None:
        yield None
        return
    rdev = rdev or _dev_of(path)
    with device_lock(state_dir, rdev, timeout):
        hold = Hold(path, rdev, Freezes(state_dir), timeout)
        hold.freeze()
        try:
            yield hold
        finally:
            hold.release()
