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


def durable_temp(path: Path, content: bytes) -> Path:
    """``content`` in a dotfile beside ``path`` (loaders and collectors skip
    it), on disk: ready to be checked, then renamed into place by commit."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def commit(tmp: Path, path: Path) -> None:
    """Rename a durable temp into place, durably."""
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    sync_dir(path.parent)


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
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    commit(tmp, path)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
