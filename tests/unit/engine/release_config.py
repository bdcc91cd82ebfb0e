"""For the release tests: a node config over a temporary state and desired directory, with nbd
"available" (the engine's release looks at what nbd maps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.observe import node as observe_node
from reconciler.spec.config import Config, load_config


def nbd_node_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    state, desired = tmp_path / "state", tmp_path / "desired"
    for d in (state, desired):
        d.mkdir(mode=0o700)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"desiredDir: {desired}\nstateDir: {state}\nallowedRoots: [{tmp_path}]\n")
    monkeypatch.setattr(observe_node, "available_mappers", lambda: frozenset({"fuse", "nbd"}))
    return load_config(cfg)
