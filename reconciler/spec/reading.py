"""Reading desired files, and the trust checks on the way: which files a
path names (one scandir per directory, listings kept while it is unchanged,
editor leftovers ignored), the directories read from (root's, not writable by
others, up to /), and each file's bytes read through a checked descriptor
(root's, regular, small, no symlink out of its directory).

Imported by spec/loader.py (a load), and for ``discover``/``is_ignored`` by
the daemon (daemon/passes.py, daemon/dirwatch.py), which lists what a load
would list.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from reconciler.spec import security
from reconciler.spec.diagnostics import Diagnostic
from reconciler.spec.pinned import Pin, Pins, Signature, signature

MAX_FILE_BYTES = 1 << 20
YAML_SUFFIXES = (".yaml", ".yml")
# Editors and tools leave these next to real files; they are never specs.
IGNORED_PATTERNS = (".*", "*~", "*.swp", "*.swo", "*.tmp", "#*#")

# A file whose mtime or ctime is this close to when it was read could change
# again without either moving (timestamps are as coarse as the kernel's
# clock tick, or a second on some filesystems): it is read again next time.
RACY_NS = 2_000_000_000
LISTING_RACY_NS = RACY_NS  # the same for a directory (tests settle files only)


_IGNORED = re.compile("|".join(fnmatch.translate(pat) for pat in IGNORED_PATTERNS))


def is_ignored(name: str) -> bool:
    return _IGNORED.match(name) is not None


def discover(paths: Iterable[Path], pins: Pins | None = None
             ) -> tuple[list[Path], list[Diagnostic]]:
    """The spec files named by ``paths``: YAML files directly inside a
    directory (not recursive; sorted by name), or files given by name.
    A directory is read with one scandir: an entry's type comes with it, so a
    regular file costs no stat (a daemon pass lists every file). A directory
    in ``pins`` is listed from the real one pinned there; the paths returned
    are named as given all the same."""
    files: list[Path] = []
    diags: list[Diagnostic] = []
    for p in paths:
        if pins is not None and (why := pins.unopened.get(p)) is not None:
            diags.append(Diagnostic(p, 1, 1, "(directory)", f"cannot open it: {why}"))
            continue
        pin = pins.by_dir.get(p) if pins is not None else None
        if pin is not None or p.is_dir():
            try:
                names = _listing(p, pin.fd if pin is not None else None)
            except OSError as exc:
                diags.append(Diagnostic(p, 1, 1, "(directory)",
                                        f"cannot list it: {exc.strerror or exc}"))
                continue
            files.extend(names)
            if pins is not None and pin is not None:  # found by the Path listed (hash kept)
                pins.listed.update(dict.fromkeys(names, pin))
        elif p.exists():
            files.append(p)
        else:
            diags.append(Diagnostic(p, 1, 1, "(file)", "no such file or directory"))
    return files, diags


# directory -> (its signature when listed, the spec file names in it)
_LISTINGS: dict[Path, tuple[Signature | None, tuple[Path, ...]]] = {}


def _listing(directory: Path, fd: int | None = None) -> tuple[Path, ...]:
    """The spec files in ``directory`` (or in the directory open as ``fd``,
    named ``directory``), sorted by name. A listing is kept while the
    directory's signature is unchanged: adding, removing or renaming an
    entry moves its mtime and ctime (not racy: see RACY_NS). The signature
    holds the inode: a listing of one revision never answers for another
    that the same name leads to now."""
    st = os.stat(directory) if fd is None else os.fstat(fd)
    kept = _LISTINGS.get(directory)
    if kept is not None and kept[0] == signature(st):
        return kept[1]
    listed_at = time.time_ns()
    with os.scandir(directory if fd is None else fd) as it:
        found = sorted(e.name for e in it if e.name.endswith(YAML_SUFFIXES)
                       and not is_ignored(e.name) and not _is_dir(e))
    # The same Path objects as last time where the names are the same: a
    # listing with one new file compares (and hashes) as cheaply as before.
    before = {f.name: f for f in kept[1]} if kept is not None else {}
    names = tuple(before.get(n) or directory / n for n in found)
    settled = max(st.st_mtime_ns, st.st_ctime_ns) < listed_at - LISTING_RACY_NS
    # A racy listing is kept for its Path objects only: never trusted as it is.
    _LISTINGS[directory] = (signature(st) if settled else None, names)
    return names


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """A directory, or a link to one (as Path.is_dir): such names are skipped."""
    try:
        return entry.is_dir()
    except OSError:
        return False


class Untrusted(Exception):
    """A file someone other than root could have written, or a symlink out."""


class TooBig(Exception):
    pass


def _trusted_path(path: Path) -> Path:
    """The real path of ``path``: a symlink must resolve inside the file's own
    directory (the file is then used by its real path with O_NOFOLLOW, so a
    swap cannot redirect the read)."""
    if (problem := security.escapes(path, path.parent.resolve())) is not None:
        raise Untrusted(problem)
    return path.resolve(strict=True)


def _check_stat(real: Path, st: os.stat_result) -> None:
    """A regular file (a FIFO would block) owned by root (or the caller), not
    writable by group or others, and small."""
    if not stat.S_ISREG(st.st_mode):
        raise Untrusted(f"{real} is not a regular file")
    if (problem := security.unsafe(real, st, "file")) is not None:
        raise Untrusted(problem)
    if st.st_size > MAX_FILE_BYTES:
        raise TooBig(f"file is {st.st_size} bytes; the limit is {MAX_FILE_BYTES} "
                     f"(a desired-volume file is small)")


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_trusted(path: Path, pin: Pin | None) -> tuple[int, Path]:
    """A descriptor on what ``path`` names, and the path its checks name.
    In a pinned directory a plain file is opened relative to it, so the
    read is of the revision listed; a symlink there (a ConfigMap's ``..data``
    links) must lead inside the pinned directory, and is opened by its real
    path."""
    if pin is None:
        real = _trusted_path(path)
        return os.open(real, _READ_FLAGS), real
    try:
        return os.open(path.name, _READ_FLAGS, dir_fd=pin.fd), path
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # O_NOFOLLOW met a symlink: checked below
            raise
    real = _trusted_path(pin.real / path.name)
    return os.open(real, _READ_FLAGS), real


def read_trusted(path: Path, pin: Pin | None = None) -> tuple[bytes, os.stat_result]:
    """The bytes of ``path``, checked on the descriptor they are read from,
    and that descriptor's stat."""
    fd, real = _open_trusted(path, pin)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        _check_stat(real, st)
        raw = f.read(MAX_FILE_BYTES + 1)  # it may grow between fstat and read
    if len(raw) > MAX_FILE_BYTES:
        raise TooBig(f"file is larger than {MAX_FILE_BYTES} bytes")
    return raw, st


def untrusted_dirs(paths: Iterable[Path], pins: Pins | None = None) -> list[Diagnostic]:
    """The directories read from (a named file's own directory too) must be
    root's and not writable by others, up to /: else nothing is read at all.
    So must each pinned directory as it was opened (the name may lead
    elsewhere by the time the names on the way are checked)."""
    dirs = {p if p.is_dir() else p.parent for p in paths if p.exists()}
    found = [Diagnostic(d, 1, 1, "(directory)", f"refusing to read it: {problem}")
             for d in sorted(dirs) for problem in security.directory_problems(d)]
    for pin in (pins.by_dir.values() if pins is not None else ()):
        if (problem := security.unsafe(pin.real, pin.st, "directory")) is not None:
            found.append(Diagnostic(pin.logical, 1, 1, "(directory)",
                                    f"refusing to read it: {problem}"))
    return found

