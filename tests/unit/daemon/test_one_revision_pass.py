"""The daemon's pass never releases a volume that both revisions declare,
whenever the source's switch lands (issue 36, item 1).

Revision N declares `gx` in a.yaml; N+1 moves it, unchanged, to b.yaml and
puts `other` in a.yaml. A pass that listed N and read N+1 saw `gx` vanish,
and released it (unpublish, unstage, unmap), to map it again a pass later.
Here the daemon's own pass (preflight, load, the removal decision) runs on a
source layout switched with the source's own rename(2) right after each
listing, many times over; what it hands to `look` as to release is what it
would take down. Ceph is never reached: `look` stops the pass there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_one_revision import N1, SETS, N, Source, after_listing

from reconciler.daemon import passes
from reconciler.daemon.service import Daemon
from reconciler.spec import loader, reading
from reconciler.spec.config import default_config

SWITCHES = 40


class Looked(Exception):
    """The pass got as far as looking: its decision is made."""


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Daemon, Source]]:
    monkeypatch.setattr(loader, "RACY_NS", 0)  # the daemon's cache answers, as on a node
    monkeypatch.setattr(reading, "LISTING_RACY_NS", 0)
    monkeypatch.setattr(reading, "_LISTINGS", {})
    src = Source(tmp_path / "state" / "source")
    src.add("N", N)
    src.add("N1", N1)
    src.switch("N")
    config = dataclasses.replace(default_config(), desired_dir=src.current,
                                 state_dir=tmp_path / "state")
    d = Daemon(config, None)
    monkeypatch.setattr(d.watchers, "watch", lambda: None)  # no inotify thread: not the decision
    try:
        yield d, src
    finally:
        d.pool.shutdown(wait=True)


def one_pass(d: Daemon, monkeypatch: pytest.MonkeyPatch) -> tuple[set[str], set[str]]:
    """Run a pass up to its look: (the names it declares, those it releases)."""
    seen: dict[str, set[str]] = {}

    def look(candidates: list, config: object, node: object, release: list[str]) -> None:
        seen["looked"] = {v.name for v in candidates}
        seen["release"] = set(release)
        raise Looked

    monkeypatch.setattr(passes, "look", look)
    with pytest.raises(Looked):
        d.passes._reconcile()
    return seen["looked"], seen["release"]


def test_switching_revisions_under_the_passes_releases_nothing(
        daemon: tuple[Daemon, Source], monkeypatch: pytest.MonkeyPatch) -> None:
    d, src = daemon
    looked, release = one_pass(d, monkeypatch)
    assert looked == SETS["N"] and release == set()
    assert set(d.records) == {"gx"}  # managed from here on
    at = ["N"]

    def flip() -> None:
        at[0] = "N1" if at[0] == "N" else "N"
        src.switch(at[0])

    switched = after_listing(monkeypatch, flip, times=SWITCHES)
    for i in range(SWITCHES):
        d.loop.dirty_all = True  # every pass looks at every volume, as after a switch
        looked, release = one_pass(d, monkeypatch)
        assert switched[0] == i + 1, "the switch never ran: the test proves nothing"
        assert "gx" not in release, f"pass {i + 2} releases gx (looked at {sorted(looked)})"
        assert "gx" in looked and looked in (SETS["N"], SETS["N1"]), sorted(looked)
    assert d.records["gx"]["file"] in {str(src.current / "a.yaml"), str(src.current / "b.yaml")}
