"""``release --all --dry-run`` when a listing of the node's mappings fails:
unknown is not absent (safety rule 7). The package's prerm reads exit 0 as
"nothing of ours is up" and goes on with the removal; a volume found by
identity alone (an nbd mapping whose file was removed with ``onRemove:
keep``) would stay mapped and mounted with nothing to release it at
shutdown. So the dry run cannot tell (exit 1), never "nothing"."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from release_config import nbd_node_config

from reconciler.cli import release as cli_release
from reconciler.cli.exits import EXIT_FAILED
from reconciler.drivers import kernelmapper
from reconciler.drivers.run import CommandError


def _listing_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(self: kernelmapper.KernelMapper) -> list[object]:
        raise CommandError(["rbd", "device", "list", "-t", "nbd"], 1, "timed out")

    monkeypatch.setattr(kernelmapper.KernelMapper, "list", fails)


def test_a_failed_listing_is_not_nothing_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = nbd_node_config(tmp_path, monkeypatch)

    _listing_fails(monkeypatch)
    args = argparse.Namespace(paths=[], dry_run=True, output="text", step_timeout=5.0)
    rc = cli_release.cmd_release_all(args, config)
    captured = capsys.readouterr()
    assert rc == EXIT_FAILED, captured.out
    assert "nothing to take down" not in captured.out
    assert "listing nbd mappings failed" in captured.err


def test_a_release_whose_last_look_could_not_list_is_not_ok(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``release --all`` itself: its last look is what it reports held; a
    listing that failed there is not "0 thing(s) still held" (exit 0)."""
    config = nbd_node_config(tmp_path, monkeypatch)
    from reconciler.engine import release as engine_release

    monkeypatch.setattr(engine_release, "sync_all", lambda _t: None)

    _listing_fails(monkeypatch)
    done = engine_release.release_all(config, 5.0, 30.0)
    assert not done.ok
    assert any("listing nbd mappings failed" in x for x in done.left), done.left
