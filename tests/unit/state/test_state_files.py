"""The one atomic writer and the typed status file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from reconciler.state.files import commit, durable_temp, read_json, write_atomic, write_json
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
