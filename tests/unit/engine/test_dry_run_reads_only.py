"""``release --all --dry-run`` (engine/release.py ``held_now``) takes no lock:
the daemon may run beside it. So it writes nothing: not even the nbd
records' tidying (a record of an earlier boot dropped, one of a device
mapped again since), a read-modify-write of stateDir/nbd.json that, racing
the daemon's record of a mapping it just made, would write that record
away (the mapping then looks gone, not dead; its cookie is lost)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from release_config import nbd_node_config

from reconciler.drivers import kernelmapper
from reconciler.engine.release import held_now


def test_the_dry_run_leaves_the_nbd_records_alone(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = nbd_node_config(tmp_path, monkeypatch)
    state = config.state_dir
    # nbd here, nothing connected; one record of an earlier boot.
    monkeypatch.setattr(kernelmapper, "nbd_any_connected", lambda *_a, **_k: False)
    records = state / "nbd.json"
    records.write_text(json.dumps({"/dev/nbd0": {"pool": "p", "image": "i",
                                                  "boot": "an-earlier-boot"}}))
    before = records.read_bytes(), os.stat(records).st_ino
    tree = sorted(str(p) for p in tmp_path.rglob("*"))
    held_now(config, 5.0)
    assert (records.read_bytes(), os.stat(records).st_ino) == before
    assert sorted(str(p) for p in tmp_path.rglob("*")) == tree  # nothing made either
