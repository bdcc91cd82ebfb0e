"""Paths resolved without following symlinks, and acted on through descriptors.

A check on a path's text ("is it under an allowed root?") means nothing if a
component is a symlink: the mount would land wherever the link points. So
every path we mount on, bind from, create or remove is opened component by
component with symlinks refused (``openat2`` with RESOLVE_NO_SYMLINKS), and
the command then acts on ``/proc/self/fd/N`` of that descriptor (passed to the
child, with ``--no-canonicalize``): what was checked is what is used.

Imported by apply/devicesteps.py; drivers/freeze.py, drivers/fs.py,
drivers/keys.py; engine/orphans.py; observe/node.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import struct
from collections.abc import Iterator

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437  # same number on every architecture (new syscall table)
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08
O_PATH = getattr(os, "O_PATH", 0o10000000)
AT_FDCWD = -100


class UnsafePath(Exception):
    """A path we must not act on: a symlink in it, or not what it should be."""


def _openat2(dirfd: int, path: str, flags: int, resolve: int = 0) -> int:
    how = ctypes.create_string_buffer(
        struct.pack("QQQ", flags, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | resolve))
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), how, 24)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def _walk_open(path: str, flags: int, dirfd: int | None = None) -> int:
    """Fallback for kernels without openat2: one component at a time, O_NOFOLLOW
    (from ``dirfd``, never above it: ``..`` is refused)."""
    fd = os.open("/" if dirfd is None else ".", O_PATH | os.O_DIRECTORY | os.O_CLOEXEC,
                 dir_fd=dirfd)
    try:
        parts = [p for p in path.split("/") if p]
        if dirfd is not None and ".." in parts:
            raise OSError(errno.EXDEV, "'..' leads out of the directory", path)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            nfd = os.open(part, (flags if last else O_PATH | os.O_DIRECTORY)
                          | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


_HAVE_OPENAT2: bool | None = None


def _first_symlink(path: str) -> str | None:
    cur = ""
    for part in (p for p in path.split("/") if p):
        cur += "/" + part
        try:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                return cur
        except OSError:
            return None
    return None


def open_nofollow(path: str, flags: int = O_PATH) -> int:
    """A descriptor for ``path`` (absolute), refusing a symlink in any component.

    Raises UnsafePath naming the symlink, or OSError (ENOENT...) as usual.
    """
    global _HAVE_OPENAT2
    if not path.startswith("/"):
        raise UnsafePath(f"{path!r} is not an absolute path")
    flags |= os.O_CLOEXEC
    try:
        if _HAVE_OPENAT2 is not False:
            try:
                fd = _openat2(AT_FDCWD, path, flags)
                _HAVE_OPENAT2 = True
                return fd
            except OSError as exc:
                if exc.errno != errno.ENOSYS:
                    raise
                _HAVE_OPENAT2 = False
        return _walk_open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
            link = _first_symlink(path)
            if link is not None:
                raise UnsafePath(f"{path}: {link} is a symlink; refusing to follow it "
                                 "(paths are used exactly as written)") from None
        raise


def open_beneath(root: str, rel: str, flags: int = O_PATH) -> int:
    """``rel`` opened below the directory ``root`` (absolute, itself opened
    without following a symlink): no symlink in ``rel``, and no way out of
    the root (``..`` or an absolute path: openat2's RESOLVE_BENEATH). What
    is checked against the root is then what was opened, not a text."""
    global _HAVE_OPENAT2
    full = root.rstrip("/") + "/" + rel
    if rel.startswith("/") or ".." in rel.split("/"):
        raise UnsafePath(f"{full} leads out of {root}")
    flags |= os.O_CLOEXEC
    with opened(root, O_PATH | os.O_DIRECTORY) as rfd:
        try:
            if _HAVE_OPENAT2 is not False:
                try:
                    fd = _openat2(rfd, rel, flags, _RESOLVE_BENEATH)
                    _HAVE_OPENAT2 = True
                    return fd
                except OSError as exc:
                    if exc.errno != errno.ENOSYS:
                        raise
                    _HAVE_OPENAT2 = False
            return _walk_open(rel, flags, rfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
                link = _first_symlink(full)
                if link is not None:
                    raise UnsafePath(f"{full}: {link} is a symlink; refusing to follow it "
                                     "(paths are used exactly as written)") from None
                if exc.errno == errno.EXDEV:
                    raise UnsafePath(f"{full} leads out of {root}") from None
            raise


@contextlib.contextmanager
def opened(path: str, flags: int = O_PATH) -> Iterator[int]:
    fd = open_nofollow(path, flags)
    try:
        yield fd
    finally:
        os.close(fd)


def fd_path(fd: int, name: str = "") -> str:
    """The path a child process (given ``pass_fds=(fd,)``) uses for ``fd``."""
    return f"/proc/self/fd/{fd}" + (f"/{name}" if name else "")


def split(path: str) -> tuple[str, str]:
    parent, _, name = path.rstrip("/").rpartition("/")
    if not name or name in (".", ".."):
        raise UnsafePath(f"{path!r} has no last component")
    return parent or "/", name


def first_symlink(path: str) -> str | None:
    """The first component of ``path`` that is a symlink (observe: pure check)."""
    return _first_symlink(path)


def mount_id(fd: int) -> int:
    """Mount id of the mount ``fd`` lives on (the top one at its path)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.EINVAL, "no mnt_id in fdinfo")


def ensure_dir(path: str) -> bool:
    """Make ``path`` a directory, creating missing components through
    descriptors (no symlink followed). True if the last component was created
    by this call."""
    parent, name = split(path)
    if parent != "/":
        ensure_dir(parent)
    with opened(parent, O_PATH | os.O_DIRECTORY) as pfd:
        try:
            os.mkdir(name, 0o755, dir_fd=pfd)
        except FileExistsError:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePath(f"{path} is a symlink; refusing to follow it") from None
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafePath(f"{path} exists and is not a directory") from None
            return False
        # 0755 whatever the umask (the unit sets 0077): apps reach their
        # volumes through the directories made here.
        fd = os.open(name, O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        try:
            os.chmod(f"/proc/self/fd/{fd}", 0o755)
        finally:
            os.close(fd)
        return True


def ensure_file(path: str) -> bool:
    """Make ``path`` an (empty, new) regular file to bind a device node onto.
    True if created by this call."""
    parent, name = split(path)
    ensure_dir(parent)
    with opened(parent, O_PATH | os.O_DIRECTORY) as pfd:
        try:
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=pfd)
            os.close(fd)
            return True
        except FileExistsError:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePath(f"{path} is a symlink; refusing to follow it") from None
            if stat.S_ISDIR(st.st_mode):
                raise UnsafePath(f"{path} is a directory; a block volume is bound onto a "
                                 "file") from None
            return False


def identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``path`` itself (not followed), None if missing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
