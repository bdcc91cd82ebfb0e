"""Files written atomically: temp file beside, fsync, rename, fsync dir.

A crash leaves the old file or the new one, never half of one. The one
writer of the node's records (stateDir), the CSI adapter's volume files and
the metrics textfile.

Every call acts through a descriptor of the directory, never by path: the
directory is reached without following a symlink that anyone but root could
have placed, the temp file is created there with O_EXCL|O_NOFOLLOW under a
random name, its mode is set on its descriptor (fchmod), and the rename is
relative to the directory's descriptor. The metrics textfile directory is
often node_exporter's: its owner may rename, replace or symlink anything in
it at any moment, and the worst that does is change what our file holds
(which that owner could do anyway). Nothing we do there follows a link or
changes the mode or owner of anything but the inode we just created. Root's
own records (mode 0600) are refused in a directory anyone else may change.

Imported by cli/run.py; csi/files.py; daemon/ (5 modules);
drivers/freeze.py, drivers/privsock.py; engine/orphans.py,
engine/release.py; source/ (4 modules); state/ (6 modules); views.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections import deque
from collections.abc import Iterator

# Only named in annotations: a command that only reaches the daemon's
# socket through open_dir (cli/fast.py) does not pay for them.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

O_PATH = getattr(os, "O_PATH", 0o10000000)
_MAX_LINKS = 40  # as the kernel's own resolution (ELOOP beyond)
_TEMP_TRIES = 8


class CannotWrite(OSError):
    """A file could not be written (a full or read-only filesystem, ...):
    one line naming the file and the cause, ``cannot write PATH: CAUSE``."""

    def __str__(self) -> str:
        return str(self.strerror)


def _cannot_write(path: Path, exc: OSError) -> CannotWrite:
    if isinstance(exc, CannotWrite):
        return exc
    return CannotWrite(exc.errno, f"cannot write {path}: {exc.strerror or exc}")


def _trusted_uids() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


def foreign(st: os.stat_result) -> str | None:
    """Why a directory (its stat) may be changed by someone other than root
    (or whoever runs this), or None."""
    if st.st_uid not in _trusted_uids():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def _may_follow(dir_st: os.stat_result, link_st: os.stat_result) -> bool:
    """A symlink is followed only if no one but root could have put it there
    or can swap it: root's link, in root's directory that others cannot
    write (or a sticky one, where only the link's owner may rename it)."""
    return (link_st.st_uid in _trusted_uids() and dir_st.st_uid in _trusted_uids()
            and (not dir_st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                 or bool(dir_st.st_mode & stat.S_ISVTX)))


def open_dir(directory: Path, create: bool = False, mode: int = 0o700) -> int:
    """An O_RDONLY descriptor of ``directory``, resolved one component at a
    time: a symlink is followed only as ``_may_follow`` allows (``/var/run``
    is root's and fine; one in node_exporter's directory is not). With
    ``create``, missing components are made (``mode`` for the last, 0755
    above) through their parent's descriptor."""
    parts = deque(p for p in os.path.abspath(directory).split("/") if p)
    fd = os.open("/", O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    links = 0
    try:
        while parts:
            part = parts.popleft()
            flags = O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                nfd = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, mode if not parts else 0o755, dir_fd=fd)
                nfd = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                link_st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(link_st.st_mode):
                    raise
                links += 1
                if links > _MAX_LINKS or not _may_follow(os.fstat(fd), link_st):
                    raise OSError(errno.ELOOP, f"{part} is a symlink someone other than root "
                                  "could have placed; not followed", str(directory)) from None
                target = os.readlink(part, dir_fd=fd)
                parts.extendleft(reversed([p for p in target.split("/") if p]))
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                continue
            os.close(fd)
            fd = nfd
        # O_PATH cannot be fsynced: the directory itself, opened again.
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def opened_dir(directory: Path, create: bool = False) -> Iterator[int]:
    fd = open_dir(directory, create)
    try:
        yield fd
    finally:
        os.close(fd)


def ensure_dir(directory: Path) -> None:
    """``directory`` and its missing parents, made through descriptors."""
    os.close(open_dir(directory, create=True))


def _new_temp(dfd: int, path: Path, content: bytes, mode: int) -> str:
    """``content`` in a new dotfile beside ``path`` (loaders and collectors
    skip it) under a random name, on disk, with ``mode`` set on its
    descriptor; its name in the directory ``dfd``."""
    import secrets  # hashlib and hmac with it: only where a file is written

    for _ in range(_TEMP_TRIES):
        name = f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except FileExistsError:
            continue
        break
    else:
        raise OSError(errno.EEXIST, "no free temp name")
    try:
        os.fchmod(fd, mode)  # this inode, whatever the umask; never a path
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)
        raise
    finally:
        os.close(fd)
    return name


def _private_here(dfd: int, path: Path) -> None:
    if (why := foreign(os.fstat(dfd))) is not None:
        raise CannotWrite(errno.EPERM, f"cannot write {path}: its directory is {why}; "
                          "root's records are kept only where no one else may change them")


def durable_temp(path: Path, content: bytes) -> Path:
    """``content`` in a dotfile beside ``path`` (loaders and collectors skip
    it), on disk: ready to be checked, then renamed into place by commit.
    Raises CannotWrite, naming ``path``."""
    try:
        with opened_dir(path.parent) as dfd:
            _private_here(dfd, path)
            return path.parent / _new_temp(dfd, path, content, 0o600)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc


def _rename(sfd: int, tmp: str, dfd: int, path: Path) -> None:
    try:
        os.rename(tmp, path.name, src_dir_fd=sfd, dst_dir_fd=dfd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=sfd)
        if isinstance(exc, OSError):
            raise _cannot_write(path, exc) from exc
        raise
    try:
        os.fsync(dfd)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc


def commit(tmp: Path, path: Path) -> None:
    """Rename a durable temp into place, durably. Raises CannotWrite."""
    try:
        sfd = open_dir(tmp.parent)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc
    try:
        try:
            dfd = open_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp.name, dir_fd=sfd)
            raise _cannot_write(path, exc) from exc
        try:
            _rename(sfd, tmp.name, dfd, path)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def sync_dir(directory: Path) -> None:
    with opened_dir(directory) as fd:
        os.fsync(fd)


def remove(path: Path) -> None:
    """Unlink ``path`` (never followed: the link itself) and sync its
    directory; FileNotFoundError when there is none."""
    with opened_dir(path.parent) as dfd:
        os.unlink(path.name, dir_fd=dfd)
        os.fsync(dfd)


def open_lock(path: Path) -> int:
    """A lock file's descriptor (made 0600, its directory too if missing):
    opened through its directory's descriptor, a symlink never followed."""
    with opened_dir(path.parent, create=True) as dfd:
        return os.open(path.name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                       dir_fd=dfd)


def write_atomic(path: Path, content: bytes, mode: int | None = None,
                 make_dir: bool = False) -> None:
    """Replace ``path`` with ``content``. ``mode`` None: a private record
    (0600), refused in a directory others may change; a mode (the metrics
    textfile's 0644) may be written where another user owns the directory.
    ``make_dir``: create the directory (0700) if missing."""
    try:
        dfd = open_dir(path.parent, create=make_dir)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc
    try:
        if mode is None:
            _private_here(dfd, path)
        try:
            tmp = _new_temp(dfd, path, content, 0o600 if mode is None else mode)
        except OSError as exc:
            raise _cannot_write(path, exc) from exc
        _rename(dfd, tmp, dfd, path)
    finally:
        os.close(dfd)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(),
                 make_dir=True)


# The next write of a record needs a new copy beside the old one: with less
# free than this (or twice the biggest record), writes are about to fail.
MIN_FREE_BYTES = 64 * 1024


def space_problem(directory: Path, biggest: Path | None = None) -> str | None:
    """Why a record may not fit in ``directory`` now, as root sees it (no
    block or no inode left), without writing anything; None: it fits."""
    try:
        st = os.statvfs(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{exc.strerror}"
    need = MIN_FREE_BYTES
    if biggest is not None:
        with contextlib.suppress(OSError):
            need = max(need, 2 * biggest.stat().st_size)
    free = st.f_bfree * st.f_frsize
    if free < need:
        return f"No space left on device ({free} bytes free, a record needs {need})"
    if st.f_files and st.f_ffree == 0:
        return "No inode left on device"
    return None


def read_json(path: Path, default: Any = None) -> Any:
    """A record; ``default`` when there is none. A symlink is not followed
    (ELOOP): only root writes here, and root never puts one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return default
    with os.fdopen(fd, "rb") as f:
        return json.loads(f.read())
