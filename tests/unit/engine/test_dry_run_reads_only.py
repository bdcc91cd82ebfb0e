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

from reconciler.drivers import kernelmapper
from reconciler.engine.release import held_now
from reconciler.observe import node as observe_node
from reconciler.spec.config import load_config


def test_the_dry_run_leaves_the_nbd_records_alone(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    state, desired = tmp_path / "state", tmp_path / "desired"
    for d in (state, desired):
        d.mkdir(mode=0o700)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"desiredDir: {desired}\nstateDir: {state}\nallowedRoots: [{tmp_path}]\n")
    config = load_config(cfg)
    # nbd here, nothing connected; one record of an earlier boot.
    monkeypatch.setattr(observe_node, "available_mappers", lambda: frozenset({"fuse", "nbd"}))
    monkeypatch.setattr(kernelmapper, "nbd_any_connected", lambda *_a, **_k: False)
    records = state / "nbd.json"
    records.write_text(json.dumps({"/dev/nbd0": {"pool": "p", "image": "i",
                                                  "boot": "an-earlier-boot"}}))
    before = records.read_bytes(), os.stat(records).st_ino
    tree = sorted(str(p) for p in tmp_path.rglob("*"))
    held_now(config, 5.0)
    assert (records.read_bytes(), os.stat(records).st_ino) == before
    assert sorted(str(p) for p in tmp_path.rglob("*")) == tree  # nothing made either
