"""Files written atomically: temp file beside, fsync, rename, fsync dir.

A crash leaves the old file or the new one, never half of one. The one
writer of the node's records (stateDir), the CSI adapter's volume files and
the metrics textfile.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


class CannotWrite(OSError):
    """A file could not be written (a full or read-only filesystem, ...):
    one line naming the file and the cause, ``cannot write PATH: CAUSE``."""

    def __str__(self) -> str:
        return str(self.strerror)


def _cannot_write(path: Path, exc: OSError) -> CannotWrite:
    if isinstance(exc, CannotWrite):
        return exc
    return CannotWrite(exc.errno, f"cannot write {path}: {exc.strerror or exc}")


def durable_temp(path: Path, content: bytes) -> Path:
    """``content`` in a dotfile beside ``path`` (loaders and collectors skip
    it), on disk: ready to be checked, then renamed into place by commit.
    Raises CannotWrite, naming ``path``."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _cannot_write(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _cannot_write(path, exc) from exc
        raise
    return Path(tmp)


def commit(tmp: Path, path: Path) -> None:
    """Rename a durable temp into place, durably. Raises CannotWrite."""
    try:
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _cannot_write(path, exc) from exc
        raise
    try:
        sync_dir(path.parent)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc


def sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, content: bytes, mode: int | None = None) -> None:
    """Replace ``path`` with ``content`` (mode: the new file's, else 0600)."""
    tmp = durable_temp(path, content)
    if mode is not None:
        try:
            os.chmod(tmp, mode)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise _cannot_write(path, exc) from exc
            raise
    commit(tmp, path)


def write_json(path: Path, data: Any) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


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
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
