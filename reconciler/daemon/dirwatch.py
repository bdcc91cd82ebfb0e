"""What wakes the daemon for its desired files: inotify, on every directory
whose change can change what the files say.

- The directory ``desiredDir`` leads to: a file added, changed or removed
  (editor droppings and dotfiles aside).
- Every directory holding a symlink on the way there, for that one name: a
  deploy swaps ``current -> releases/r2`` in ``/srv/gitops``, not in the
  directory the old link led to (spec/linkpath.py). Likewise for ``csi.dir``
  (its files are the adapter's own, which wakes the daemon itself).
- The directory holding the last component, for that name: the directory
  itself replaced, removed, or made.

On any of these the daemon wakes, and its pass resolves the paths again
(``watch``), so the watches follow a swapped link. The kernel's queue of
events can overflow (a burst faster than we read, or a stalled process):
what changed is then unknown, and every volume is looked at.

Not watchdog: it drops the overflow event without a word (the installed 6.0
and Debian 12's 2.2.1 alike skip every event whose watch descriptor is -1 in
``Inotify.read_events``, which is how the kernel reports ``IN_Q_OVERFLOW``),
and it runs a thread per directory. This is one inotify descriptor and one
thread, through libc.

Imported by daemon/watchers.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import select
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from reconciler.spec.linkpath import resolve
from reconciler.spec.reading import is_ignored

log = logging.getLogger("rbd-reconciler")

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED = 0x4000, 0x8000
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
ENTRIES = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF
FILES = ENTRIES | IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name, NUL-padded
READ_SIZE = 64 * 1024

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class Watch:
    """One directory: any file in it (``files``) and/or these entries."""

    files: bool = False
    names: set[str] = field(default_factory=set)

    def wakes(self, name: str) -> bool:
        return not name or name in self.names or (self.files and not is_ignored(name))


def plan(files_of: Iterable[Path], links_of: Iterable[Path] = ()) -> dict[Path, Watch]:
    """The directories to watch: for each of ``files_of``, its files, every
    symlink on its path and its own entry; for ``links_of``, the last two."""
    out: dict[Path, Watch] = {}
    for path, files in [*((p, True) for p in files_of), *((p, False) for p in links_of)]:
        found = resolve(path)
        for parent, name in (*found.links, found.missing or (found.target.parent,
                                                             found.target.name)):
            out.setdefault(parent, Watch()).names.add(name)
        if files and found.missing is None:
            out.setdefault(found.target, Watch()).files = True
    return out


class DirWatcher:
    """One inotify descriptor, read by one daemon thread. ``on_change`` for an
    event that matters, ``on_overflow`` when the kernel lost events."""

    def __init__(self, on_change: Callable[[], None], on_overflow: Callable[[], None]) -> None:
        self.on_change = on_change
        self.on_overflow = on_overflow
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = int(fd)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._lock = threading.Lock()
        self._by_wd: dict[int, tuple[Path, Watch]] = {}
        self._wd_of: dict[Path, int] = {}
        self._thread = threading.Thread(target=self._read_loop, name="dirwatch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            for fd in (self.fd, self._stop_r, self._stop_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def watching(self) -> dict[Path, Watch]:
        with self._lock:
            return {path: watch for path, watch in self._by_wd.values()}

    def watch(self, wanted: dict[Path, Watch]) -> None:
        """Watch exactly ``wanted`` (from ``plan``): new directories added,
        gone ones dropped, what each wakes for updated. A directory that
        cannot be watched now (gone meanwhile) is left to the next call."""
        with self._lock:
            for path in [p for p in self._wd_of if p not in wanted]:
                wd = self._wd_of.pop(path)
                self._by_wd.pop(wd, None)
                _libc.inotify_rm_watch(self.fd, wd)
            for path, want in wanted.items():
                mask = (FILES if want.files else ENTRIES) | IN_ONLYDIR | IN_DONT_FOLLOW
                wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
                if wd < 0:
                    log.debug("not watching %s: %s", path, os.strerror(ctypes.get_errno()))
                    if (gone := self._wd_of.pop(path, None)) is not None:
                        self._by_wd.pop(gone, None)
                    continue
                old = self._wd_of.get(path)
                if old is not None and old != wd:  # the directory was replaced meanwhile
                    self._by_wd.pop(old, None)
                    _libc.inotify_rm_watch(self.fd, old)  # the old one, wherever it went
                self._wd_of[path] = int(wd)
                self._by_wd[int(wd)] = (path, want)

    def _read_loop(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_r in ready:
                return
            try:
                data = os.read(self.fd, READ_SIZE)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EINTR):
                    continue
                log.error("events: reading inotify failed (%s); the desired files are "
                          "looked at only at the resync from now on", exc)
                return
            self.handle(data)

    def handle(self, data: bytes) -> None:
        """Act on a buffer of inotify events (as read from the descriptor)."""
        change = overflow = False
        for wd, mask, name in _events(data):
            if wd == -1 or mask & IN_Q_OVERFLOW:
                overflow = True
                continue
            with self._lock:
                entry = self._by_wd.get(wd)
                if entry is not None and mask & IN_IGNORED:  # its directory went
                    del self._by_wd[wd]
                    if self._wd_of.get(entry[0]) == wd:
                        del self._wd_of[entry[0]]
            if entry is not None and (mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF)
                                      or entry[1].wakes(name)):
                change = True
        if overflow:
            log.warning("events: the kernel's inotify queue overflowed (events were lost); "
                        "looking at every volume")
            self.on_overflow()
        elif change:
            self.on_change()


def _events(data: bytes) -> Iterable[tuple[int, int, str]]:
    offset = 0
    while offset + EVENT.size <= len(data):
        wd, mask, _cookie, length = EVENT.unpack_from(data, offset)
        raw = data[offset + EVENT.size: offset + EVENT.size + length]
        offset += EVENT.size + length
        yield wd, mask, os.fsdecode(raw.split(b"\0", 1)[0])
