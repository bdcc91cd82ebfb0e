"""The daemon's pass against a deploy tool that switches the desired
directory's link non-atomically (issue 36, item 1; safety rules 3 and 7).

`ln -sfn` as busybox does it, or `rm current && ln -s ... current`, leaves a
moment with no desired directory. A pass whose preflight saw the link and
whose load did not must release nothing: the directory is unreadable, not
empty. With CSI volumes beside it the mass-removal guard does not help (the
desired set is not empty), so only the load can say so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_one_revision import N1, N, Source, after_listing, doc
from test_one_revision_pass import one_pass

from reconciler.daemon import passes
from reconciler.daemon.service import Daemon
from reconciler.spec import loader, reading
from reconciler.spec.config import default_config


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Daemon, Source]]:
    monkeypatch.setattr(loader, "RACY_NS", 0)
    monkeypatch.setattr(reading, "LISTING_RACY_NS", 0)
    monkeypatch.setattr(reading, "_LISTINGS", {})
    state = tmp_path / "state"
    src = Source(state / "source")
    src.add("N", N)
    src.switch("N")
    csi = state / "csi.d"
    csi.mkdir(mode=0o755)
    (csi / "c1.yaml").write_text(doc("c1"))
    (csi / "c1.yaml").chmod(0o644)
    config = dataclasses.replace(default_config(), desired_dir=src.current, state_dir=state)
    assert config.csi_dir == csi
    d = Daemon(config, None)
    monkeypatch.setattr(d.watchers, "watch", lambda: None)
    try:
        yield d, src
    finally:
        d.pool.shutdown(wait=True)


def test_a_link_missing_for_the_load_releases_nothing(
        daemon: tuple[Daemon, Source], monkeypatch: pytest.MonkeyPatch) -> None:
    d, src = daemon
    looked, release = one_pass(d, monkeypatch)
    assert looked == {"gx", "c1"} and release == set()
    assert set(d.records) == {"gx", "c1"}
    target = src.layout.target("current")
    assert target is not None
    real_load = passes.load_desired
    gaps = [0]

    def load_in_the_gap(*args: object, **kwargs: object) -> object:
        # The preflight saw the link; the tool's unlink lands now, its
        # symlink right after the load.
        src.current.unlink()
        try:
            gaps[0] += 1
            return real_load(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            src.layout.switch("current", target)

    monkeypatch.setattr(passes, "load_desired", load_in_the_gap)
    d.loop.dirty_all = True
    looked, release = one_pass(d, monkeypatch)
    assert gaps[0] == 1
    assert "gx" not in release, f"the pass releases gx (looked at {sorted(looked)})"
    assert "gx" in d.records


def test_a_directory_that_never_holds_still_releases_nothing(
        daemon: tuple[Daemon, Source], monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched and pruned under every attempt of the load: what the last
    attempt could read is no removal (safety rule 3)."""
    d, src = daemon
    looked, release = one_pass(d, monkeypatch)
    assert looked == {"gx", "c1"} and set(d.records) == {"gx", "c1"}

    def churn() -> None:
        src.made += 1
        name = f"R{src.made}"
        src.add(name, N1)
        src.switch(name)
        src.prune()
        src.switch(name)
        src.prune()

    done = after_listing(monkeypatch, churn, times=1000)
    d.loop.dirty_all = True
    looked, release = one_pass(d, monkeypatch)
    assert 1 < done[0] <= loader.PIN_ATTEMPTS + 1  # bounded (the CSI dir lists too)
    assert release == set(), f"released {sorted(release)} from a load that never held still"
    assert {"gx", "c1"} <= set(d.records)
