"""What wakes the daemon between resyncs: the node telling us something changed.

Level-triggered still: an event only names the volumes to look at again; the
pass that follows observes them afresh and acts on what it sees, never on the
event. Every source here is a file descriptor polled by one thread:

- the mount table: ``/proc/self/mountinfo`` signals POLLPRI/POLLERR on any
  mount, unmount or remount in our namespace; a re-read and a diff of what
  the planner reads of each mount (options, the filesystem's too, source,
  type) name the mount points that changed; a volume is woken for a change
  at one of its paths or above it (a mount over a parent directory hides it);
- block devices: the kernel's uevents (a NETLINK_KOBJECT_UEVENT socket), for
  a device of ours removed or changed (krbd and rbd-nbd announce a resize
  this way);
- helpers: a pidfd per rbd-fuse helper, readable once the helper exits (a
  dead rbd-fuse is seen at once); and one per process that uses a dead
  helper's volume (its repair waits for them);
- the kernel log (``/dev/kmsg``): a warning or error naming a device of ours
  (an I/O error, ``EXT4-fs error``, a filesystem going read-only, which no
  mount event announces). It wakes the volume at once and once more a moment
  later (the kernel may flip the flag after its message), at most once a
  second while messages keep coming.

I/O that stops completing (a Ceph out of reach) makes no event at all: the
mapped devices' counters are read from sysfs every ``events.ioPollSeconds``
(observe/iowatch.py), and a volume whose device starts or stops stalling is
looked at again.

An image resized elsewhere reaches no kernel object when it is mapped through
rbd-fuse, and a librbd or rados watch would be a *watcher* of the image, which
the one-writer claim and other nodes count as a user. So the mapped images'
headers are read (no open, no watch) every ``events.imagePollSeconds``, in a
thread of their own: a stalled Ceph holds up that poll, never the events.

Imported by daemon/interest.py, daemon/watchers.py.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from reconciler.facts.kmsg import names_for_message, parse_kmsg
from reconciler.facts.parsers import parse_mountinfo
from reconciler.facts.uevent import Uevent, parse_uevent
from reconciler.observe.iowatch import IoWatch

log = logging.getLogger("rbd-reconciler")

MOUNTINFO = "/proc/self/mountinfo"
KMSG = "/dev/kmsg"
KMSG_AGAIN_S = 1.0  # a volume a kernel message named is looked at again this much later
NETLINK_KOBJECT_UEVENT = 15
UEVENT_KERNEL_GROUP = 1
UEVENT_ACTIONS = frozenset({"add", "remove", "change", "offline", "online"})

# names, why: the daemon adds them to its dirty set and wakes its loop
Mark = Callable[[Iterable[str] | None, str], None]
# (pool, image) pairs -> their current size; missing: no answer (bounded)
SizeReader = Callable[[list[tuple[str, str]]], dict[tuple[str, str], int]]


@dataclass(frozen=True)
class Interest:
    """What of the node belongs to which volume, as the last passes saw it."""

    paths: Mapping[str, str] = field(default_factory=dict)  # mount point -> volume
    devices: Mapping[str, str] = field(default_factory=dict)  # "loop3", "rbd0" -> volume
    pids: Mapping[int, str] = field(default_factory=dict)  # helper pid -> volume
    # fuse-mapped images -> (volume, size last seen): polled for resizes
    images: Mapping[tuple[str, str], tuple[str, int]] = field(default_factory=dict)


# What the planner reads of one mount: point first (what a change names).
MountState = tuple[str, int, int, int, str, frozenset[str], str, str, frozenset[str]]


def mount_keys(mountinfo: str) -> dict[int, MountState]:
    """Mount id -> what the planner acts on of that mount. A remount keeps
    the id and the point (``remount,bind,ro``), so its options, the
    filesystem's options (read-only after an error), the source and the
    type are compared too; mountinfo's optional fields (propagation) are not."""
    return {m.mount_id: (m.mount_point, m.parent_id, m.major, m.minor, m.root, m.options,
                         m.fs_type, m.source, m.super_options)
            for m in parse_mountinfo(mountinfo)}


def changed_points(before: Mapping[int, MountState], after: Mapping[int, MountState]
                   ) -> set[str]:
    """Mount points where a mount came, went or changed."""
    return ({v[0] for k, v in before.items() if after.get(k) != v}
            | {v[0] for k, v in after.items() if before.get(k) != v})


def names_for_points(points: Iterable[str], paths: Mapping[str, str]) -> set[str]:
    """Volumes with a path at a changed point, or below one: a mount over a
    directory above a publish hides the publish as surely as one on top."""
    ordered = sorted(paths)
    names = set()
    for point in points:
        if point in paths:
            names.add(paths[point])
        below = point.rstrip("/") + "/"
        for p in ordered[bisect_left(ordered, below):]:
            if not p.startswith(below):
                break
            names.add(paths[p])
    return names


def names_for_uevent(ev: Uevent, devices: Mapping[str, str]) -> set[str]:
    if ev.action not in UEVENT_ACTIONS or ev.subsystem != "block":
        return set()
    name = devices.get(ev.devname or "")
    return {name} if name is not None else set()


class EventHub:
    """One thread polling the node's event sources; ``mark`` is called with
    the volumes an event concerns (None: all of them, when events were lost)."""

    def __init__(self, mark: Mark, read_sizes: SizeReader | None = None,
                 image_poll_seconds: float = 0.0,
                 io_watch: Callable[[], IoWatch] | None = None,
                 io_poll_seconds: float = 0.0) -> None:
        self.mark = mark
        self.read_sizes = read_sizes
        self.image_poll_seconds = image_poll_seconds
        self.io_watch = io_watch  # the current Node's (a reload makes a new one)
        self.io_poll_seconds = io_poll_seconds
        self._lock = threading.Lock()
        self._interest = Interest()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pidfds: dict[int, tuple[int, str]] = {}  # fd -> (pid, volume)
        # Helpers already reported gone: the interest names them until their
        # volume is looked at again, which must not mark it again and again.
        self._gone: set[int] = set()
        self._mounts: dict[int, MountState] = {}
        self._threads: list[threading.Thread] = []
        self._mountinfo = None
        self._netlink: socket.socket | None = None
        self._kmsg: int | None = None
        self._again: dict[str, float] = {}  # volume -> when to look again (kernel log)

    # -- the daemon's side --------------------------------------------------------
    def start(self) -> None:
        self._mountinfo = open(MOUNTINFO, "rb", buffering=0)  # noqa: SIM115 (held open)
        self._mounts = mount_keys(self._read_mountinfo())
        self._netlink = _uevent_socket()
        self._kmsg = _kmsg_reader()
        self._threads.append(threading.Thread(target=self._run, name="events", daemon=True))
        if self.read_sizes is not None and self.image_poll_seconds > 0:
            self._threads.append(threading.Thread(target=self._poll_images,
                                                  name="image-poll", daemon=True))
        if self.io_watch is not None and self.io_poll_seconds > 0:
            self._threads.append(threading.Thread(target=self._poll_io, name="io-poll",
                                                  daemon=True))
        for t in self._threads:
            t.start()

    def update(self, interest: Interest) -> None:
        with self._lock:
            self._interest = interest
        self._nudge()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._nudge()
        for t in self._threads:
            t.join(timeout=timeout)
        if any(t.is_alive() for t in self._threads):
            return  # a stuck size read: its thread is a daemon thread, leave the fds
        for fd in list(self._pidfds):
            os.close(fd)
        self._pidfds.clear()
        if self._mountinfo is not None:
            self._mountinfo.close()
        if self._netlink is not None:
            self._netlink.close()
        if self._kmsg is not None:
            os.close(self._kmsg)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the events thread ---------------------------------------------------------
    def _nudge(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        assert self._mountinfo is not None
        poller.register(self._mountinfo.fileno(), select.POLLPRI | select.POLLERR)
        if self._netlink is not None:
            poller.register(self._netlink.fileno(), select.POLLIN)
        if self._kmsg is not None:
            poller.register(self._kmsg, select.POLLIN)
        self._sync_pidfds(poller)
        while not self._stop.is_set():
            try:
                ready = poller.poll(self._again_in_ms())
            except InterruptedError:
                continue
            self._look_again()
            for fd, _ in ready:
                try:
                    self._handle(poller, fd)
                except Exception:  # one bad event must not end the watching
                    log.exception("events: handling fd %d failed", fd)

    def _handle(self, poller: select.poll, fd: int) -> None:
        if fd == self._wake_r:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            self._sync_pidfds(poller)
        elif self._mountinfo is not None and fd == self._mountinfo.fileno():
            self._mounts_changed()
        elif self._netlink is not None and fd == self._netlink.fileno():
            self._uevents()
        elif fd == self._kmsg:
            self._kernel_log()
        elif fd in self._pidfds:
            pid, name = self._pidfds.pop(fd)
            poller.unregister(fd)
            os.close(fd)
            self._gone.add(pid)
            self.mark([name], f"helper pid {pid} exited")

    def _read_mountinfo(self) -> str:
        assert self._mountinfo is not None
        self._mountinfo.seek(0)
        chunks = []
        while chunk := self._mountinfo.read(1 << 16):
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="surrogateescape")

    def _mounts_changed(self) -> None:
        now = mount_keys(self._read_mountinfo())
        points = changed_points(self._mounts, now)
        self._mounts = now
        with self._lock:
            paths = self._interest.paths
        names = names_for_points(points, paths)
        if names:
            shown = sorted(points & set(paths)) or sorted(points)[:3]
            self.mark(names, f"mounts changed at {', '.join(shown)}")

    def _kernel_log(self) -> None:
        assert self._kmsg is not None
        with self._lock:
            devices = self._interest.devices
        names: set[str] = set()
        first = ""
        while True:
            try:
                record = os.read(self._kmsg, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # overwritten before we read them: on with the next
                continue
            if not record:
                break
            msg = parse_kmsg(record)
            hit = names_for_message(msg, devices) if msg is not None else set()
            if hit and msg is not None:
                names |= hit
                first = first or msg.text[:120]
        now = time.monotonic()
        fresh = {n for n in names if n not in self._again}
        for n in names:
            self._again.setdefault(n, now + KMSG_AGAIN_S)
        if fresh:
            self.mark(fresh, f"kernel: {first}")

    def _again_in_ms(self) -> int | None:
        """poll(2)'s timeout: until the next look again (None: none due)."""
        if not self._again:
            return None
        return max(0, int((min(self._again.values()) - time.monotonic()) * 1000) + 1)

    def _look_again(self) -> None:
        now = time.monotonic()
        due = {n for n, t in self._again.items() if t <= now}
        for n in due:
            del self._again[n]
        if due:
            self.mark(due, "kernel: looking again after its message")

    def _uevents(self) -> None:
        assert self._netlink is not None
        with self._lock:
            devices = self._interest.devices
        names: set[str] = set()
        while True:
            try:
                data = self._netlink.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # the kernel dropped events: look at all
                    self.mark(None, "uevents were lost (receive buffer overflow)")
                    continue
                raise
            ev = parse_uevent(data)
            if ev is not None:
                names |= names_for_uevent(ev, devices)
        if names:
            self.mark(names, "block device uevent")

    def _sync_pidfds(self, poller: select.poll) -> None:
        with self._lock:
            wanted = dict(self._interest.pids)
        for fd, (pid, _) in list(self._pidfds.items()):
            if wanted.get(pid) is None:
                poller.unregister(fd)
                os.close(fd)
                del self._pidfds[fd]
        self._gone &= set(wanted)
        held = {pid for pid, _ in self._pidfds.values()} | self._gone
        for pid, name in wanted.items():
            if pid in held:
                continue
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone.add(pid)
                self.mark([name], f"helper pid {pid} is gone")
                continue
            except OSError as exc:  # no pidfd on this kernel: the resync covers it
                log.debug("events: pidfd_open(%d): %s", pid, exc)
                continue
            self._pidfds[fd] = (pid, name)
            poller.register(fd, select.POLLIN)

    # -- the image-size poll -------------------------------------------------------
    def _poll_images(self) -> None:
        assert self.read_sizes is not None
        seen: dict[tuple[str, str], int] = {}
        while not self._stop.wait(self.image_poll_seconds):
            with self._lock:
                images = dict(self._interest.images)
            if not images:
                continue
            try:
                sizes = self.read_sizes(sorted(images))
            except Exception as exc:  # Ceph away: the resync still comes
                log.debug("events: image size poll failed: %s", exc)
                continue
            changed = set()
            for key, (name, known) in images.items():
                size = sizes.get(key)
                if size is None:
                    continue
                if size != known and seen.get(key) != size:
                    changed.add(name)
                seen[key] = size
            for key in [k for k in seen if k not in images]:
                del seen[key]
            if changed:
                self.mark(changed, "image resized elsewhere")


    # -- the I/O poll -------------------------------------------------------------
    def _poll_io(self) -> None:
        """Sample every mapped device of ours (sysfs only: never blocks on the
        device); a volume whose device starts or stops stalling is marked."""
        assert self.io_watch is not None
        stalled: set[str] = set()
        while not self._stop.wait(self.io_poll_seconds):
            with self._lock:
                devices = {f"/dev/{d}": name for d, name in self._interest.devices.items()}
            try:
                watch = self.io_watch()
                watch.sample(devices, forget=True)
                now = {name for dev, name in devices.items() if watch.stall(dev) is not None}
            except Exception:  # one bad read must not end the watching
                log.exception("events: I/O poll failed")
                continue
            if now - stalled:
                self.mark(now - stalled, "I/O not completing")
            if stalled - now:
                self.mark(stalled - now, "I/O completing again")
            stalled = now


def _kmsg_reader() -> int | None:
    """/dev/kmsg, from its end: only what the kernel says from now on."""
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:  # no CAP_SYSLOG (dmesg_restrict), a container without it
        log.info("events: no kernel log (%s); I/O errors and filesystems gone read-only "
                 "are seen at the resync", exc)
        return None
    try:
        os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        os.close(fd)
        return None
    return fd


def _uevent_socket() -> socket.socket | None:
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                             NETLINK_KOBJECT_UEVENT)
        with contextlib.suppress(OSError):  # a burst of 1,000 loop changes fits
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.bind((0, UEVENT_KERNEL_GROUP))
    except OSError as exc:  # a container without netlink: mounts and pidfds still work
        log.info("events: no kernel uevents (%s); device changes are seen at the resync", exc)
        return None
    return sock
