"""A directory read as one: opened once, listed and read through that
descriptor, and checked afterwards for having changed under the read.

The desired directory may be named through a symlink that is switched at
any moment (the source's ``current``, git-sync's ``--link``): a listing
through the link and reads through it again could see a set of files that
no revision has (issue 36, item 1). The loader (spec/loader.py) pins each
directory it is given with ``Pins`` and reads every file relative to the
pin; ``Pins.torn`` says whether that read may mix two states. Used by the
loader only (spec/loader.py and spec/reading.py).

Imported by spec/loader.py, spec/reading.py.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

Signature = tuple[int, int, int, int, int]


def signature(st: os.stat_result) -> Signature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Pin:
    """Directory ``logical`` as given (what every path the program sees is
    named by) and the real one this load reads it from: ``fd``, at ``real``,
    as it was when opened (``st``)."""

    logical: Path
    real: Path
    fd: int
    st: os.stat_result
    moved: bool  # the name led elsewhere just after the open: ``real`` is unsure

    def changed(self) -> str | None:
        """Why what was read from it may not be one state of it, or None."""
        if self.moved:
            return "it was switched while it was opened"
        st = os.fstat(self.fd)
        if st.st_nlink == 0:
            return "it was removed while it was read"
        if signature(st) != signature(self.st):
            return "it changed while it was read"
        return None


def open_pin(directory: Path) -> Pin | None:
    """``directory`` opened once: the kernel walks its links in one go. None
    for nothing there or no directory (discover says what it is); any other
    failure to open it raises (OSError, or ValueError for a path no open(2)
    takes): a directory that cannot be opened is never read as empty."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise
    st = os.fstat(fd)
    real = Path(os.path.realpath(directory))
    try:
        now = os.stat(real)
        moved = (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)
    except OSError:
        moved = True
    return Pin(directory, real, fd, st, moved)


class Pins:
    """The directories of one load, each pinned; files listed there are
    stat'ed and opened there. ``missing``: listed, then gone when read.
    ``unopened``: paths that could not be opened, and why (discover fails
    each: unreadable is not empty, safety rule 7)."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self.by_dir: dict[Path, Pin] = {}
        self.missing: list[Path] = []
        self.unopened: dict[Path, str] = {}
        self.listed: dict[Path, Pin] = {}  # file -> its pin, as discover listed it
        try:
            for p in paths:
                if p in self.by_dir or p in self.unopened:
                    continue
                try:
                    pin = open_pin(p)
                except (OSError, ValueError) as exc:
                    self.unopened[p] = getattr(exc, "strerror", None) or str(exc)
                    continue
                if pin is not None:
                    self.by_dir[p] = pin
        except BaseException:
            self.__exit__()  # those opened so far: never left open
            raise

    def __enter__(self) -> Pins:
        return self

    def __exit__(self, *exc: object) -> None:
        for pin in self.by_dir.values():
            os.close(pin.fd)

    def of(self, path: Path) -> Pin | None:
        # A file listed is found without path.parent: a new Path to hash,
        # per file per pass, was half of an unchanged pass over 1000 files.
        return self.listed.get(path) or self.by_dir.get(path.parent)

    def lstat(self, path: Path) -> os.stat_result:
        pin = self.of(path)
        if pin is None:
            return os.lstat(path)
        return os.stat(path.name, dir_fd=pin.fd, follow_symlinks=False)

    def torn(self) -> tuple[Path, str] | None:
        """A directory whose read may mix two states of it, and why."""
        for pin in self.by_dir.values():
            if (why := pin.changed()) is not None:
                return pin.logical, why
            if gone := [f.name for f in self.missing if f.parent == pin.logical]:
                return pin.logical, f"{', '.join(gone[:3])} went while it was read"
        return None
