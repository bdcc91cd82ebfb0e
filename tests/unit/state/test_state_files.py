"""The one atomic writer and the typed status file."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.state.files import (
    CannotWrite,
    commit,
    durable_temp,
    read_json,
    space_problem,
    write_atomic,
    write_json,
)
from reconciler.state.status import VolumeStatus


def test_status_writes_what_is_set_in_the_files_keys() -> None:
    doc = VolumeStatus("Published", observed_generation="abc", last_error=None,
                       notes=[]).to_json()
    # None is written (as null); a field never set is not written at all.
    assert doc == {"phase": "Published", "observedGeneration": "abc", "lastError": None,
                   "notes": []}
    assert VolumeStatus("Pending").to_json() == {"phase": "Pending"}


def test_write_json_replaces_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "status.json"
    write_json(path, {"b": 1, "a": [1, 2]})
    write_json(path, {"a": 2})
    assert read_json(path) == {"a": 2}
    assert path.read_text() == json.dumps({"a": 2}, indent=2, sort_keys=True) + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["status.json"]


def test_write_atomic_sets_the_mode_and_a_failed_rename_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "m.prom"
    write_atomic(path, b"x 1\n", mode=0o644)
    assert path.read_bytes() == b"x 1\n" and stat.S_IMODE(path.stat().st_mode) == 0o644
    tmp = durable_temp(tmp_path / "v", b"new")
    assert tmp.name.startswith(".v.") and tmp.read_bytes() == b"new"
    with pytest.raises(OSError):
        commit(tmp, tmp_path / "missing-dir" / "v.yaml")  # the rename fails
    assert not tmp.exists()
    assert sorted(os.listdir(tmp_path)) == ["m.prom"]


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs with no byte left (a file of zeros fills it)."""
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "rbdr-test-small", str(where)],
                   check=True, timeout=30)
    try:
        fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for size in (1 << 14, 1):
                while True:
                    try:
                        os.write(fd, bytes(size))
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC
                        break
        finally:
            os.close(fd)
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True, timeout=30)


def test_a_write_to_a_full_filesystem_names_the_file_and_the_cause(full_fs: Path) -> None:
    path = full_fs / "status" / "pgdata.json"
    path.parent.mkdir()  # a directory needs no block on tmpfs
    with pytest.raises(CannotWrite) as exc:
        write_json(path, {"phase": "Published"})
    assert str(exc.value) == f"cannot write {path}: No space left on device"
    assert exc.value.errno == errno.ENOSPC and "Errno" not in str(exc.value)
    assert list(path.parent.iterdir()) == []  # no temp left behind
    why = space_problem(full_fs)
    assert why is not None and why.startswith("No space left on device (0 bytes free")
    (full_fs / "filler").unlink()
    assert space_problem(full_fs) is None
    write_json(path, {"phase": "Published"})
    assert read_json(path) == {"phase": "Published"}
    assert space_problem(full_fs / "missing") is None  # not made yet: nothing to say
