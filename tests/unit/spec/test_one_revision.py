"""A load reads exactly one revision of a desired directory that is a
symlink switched with rename(2) (the GitOps source's `current`, git-sync's
`--link`), whenever the switch lands (issue 36, item 1).

Revision N declares `gx` in a.yaml; N+1 moves it, unchanged, to b.yaml and
puts `other` in a.yaml. A load that listed N and read N+1 (or the reverse)
saw a set no revision has: `gx` looked removed, and the daemon took it down.
The switches here are the source's own (Layout.switch), made at the exact
point of a load where the race bit: after the listing, or at the first read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from reconciler.source.layout import Layout
from reconciler.spec import loader, reading
from reconciler.spec.config import default_config
from reconciler.spec.loader import LoadCache, LoadResult, load

CONFIG = default_config()


def doc(name: str) -> str:
    return (f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
            f"spec:\n  image: {{pool: rbd, name: {name}, size: 1Gi}}\n")


N = {"a.yaml": doc("gx")}
N1 = {"a.yaml": doc("other"), "b.yaml": doc("gx")}
N2 = {"a.yaml": doc("other"), "b.yaml": doc("gx"), "c.yaml": doc("third")}
SETS = {"N": {"gx"}, "N1": {"gx", "other"}, "N2": {"gx", "other", "third"}}


def rev(label: str) -> str:
    """A revision's directory name as the source makes it (<commit>-<path hash>)."""
    return f"{hashlib.sha1(label.encode()).hexdigest()}-0000abcd"


class Source:
    """A source layout on disk: revs/<name>/ and `current`, switched the way
    the source switches it (one rename(2) of a new link)."""

    def __init__(self, root: Path) -> None:
        self.layout = Layout(root)
        self.layout.revs.mkdir(parents=True, mode=0o755)
        self.made = 0

    @property
    def current(self) -> Path:
        return self.layout.current

    def add(self, label: str, files: dict[str, str]) -> None:
        d = self.layout.revs / rev(label)
        d.mkdir(mode=0o755)
        for fname, text in files.items():
            (d / fname).write_text(text)
            (d / fname).chmod(0o644)
        # Exported long before it is pruned: an unlink moves its timestamps.
        os.utime(d, ns=(0, 10**9))

    def switch(self, label: str) -> None:
        if (old := self.layout.target("current")) is not None:
            self.layout.switch("previous", old)
        self.layout.switch("current", rev(label))

    def prune(self) -> None:
        """As source/sync.py's _prune: keep what current and previous name."""
        keep = {self.layout.target("current"), self.layout.target("previous")} - {None}
        assert keep, "the layout names no revision: the prune would remove them all"
        for p in self.layout.revs.iterdir():
            if p.name not in keep:
                shutil.rmtree(p)


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Source:
    # Files and listings written by the test count as settled at once: the
    # caches answer, as they do for a daemon beside old revisions.
    monkeypatch.setattr(loader, "RACY_NS", 0)
    monkeypatch.setattr(reading, "LISTING_RACY_NS", 0)
    monkeypatch.setattr(reading, "_LISTINGS", {})
    src = Source(tmp_path / "source")
    src.add("N", N)
    src.add("N1", N1)
    src.add("N2", N2)
    return src


def after_listing(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None],
                  times: int = 1) -> list[int]:
    """Run ``action`` right after each of the first ``times`` listings."""
    real, done = reading._listing, [0]

    def listing(*args: object, **kwargs: object) -> object:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        if done[0] < times:
            done[0] += 1
            action()
        return out

    monkeypatch.setattr(reading, "_listing", listing)
    return done


def at_first_read(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> list[int]:
    """Run ``action`` as the first desired file starts to load."""
    real, done = loader._load_file, [0]

    def load_file(*args: object, **kwargs: object) -> object:
        if not done[0]:
            done[0] = 1
            action()
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "_load_file", load_file)
    return done


def names(result: LoadResult) -> set[str]:
    return {v.name for v in result.volumes}


@pytest.fixture(params=["cold", "warm"])
def cache(request: pytest.FixtureRequest) -> Iterator[LoadCache | None]:
    yield LoadCache() if request.param == "warm" else None


@pytest.mark.parametrize("when", ["after the listing", "at the first read"])
@pytest.mark.parametrize(("start", "end"), [("N", "N1"), ("N1", "N")])
def test_a_switch_during_a_load_reads_one_revision(
        source: Source, monkeypatch: pytest.MonkeyPatch, cache: LoadCache | None,
        when: str, start: str, end: str) -> None:
    if cache is not None:
        # As the daemon's: warm from passes over the other revision, which
        # has a file of the same name (entries keyed by the path as named).
        source.switch(end)
        assert names(load([source.current], CONFIG, cache)) == SETS[end]
    source.switch(start)
    hook = after_listing if when == "after the listing" else at_first_read
    switched = hook(monkeypatch, lambda: source.switch(end))
    result = load([source.current], CONFIG, cache)
    assert switched[0], "the switch never ran: the test proves nothing"
    assert result.ok, [str(d) for d in result.diagnostics]
    assert names(result) in (SETS[start], SETS[end]), \
        f"a set no revision has: {sorted(names(result))}"
    # Every path is the logical one, whichever revision was read.
    [gx] = [v for v in result.volumes if v.name == "gx"]
    rev = start if names(result) == SETS[start] else end
    assert gx.source.file == source.current / ("a.yaml" if rev == "N" else "b.yaml")
    assert set(result.files) <= {source.current / n for n in ("a.yaml", "b.yaml")}
    # The next load reads the revision `current` names now: nothing cached
    # from the other one answers for a file of the same name.
    monkeypatch.undo()
    again = load([source.current], CONFIG, cache)
    assert again.ok and names(again) == SETS[end]


def test_a_revision_pruned_while_it_is_read_is_read_again_from_the_new_one(
        source: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two syncs during one load: N is pruned under it. That is no file
    removed: the load starts again from where `current` leads now."""
    source.switch("N")

    def two_syncs() -> None:
        source.switch("N1")
        source.switch("N2")
        source.prune()
        assert not (source.layout.revs / rev("N")).exists()

    done = after_listing(monkeypatch, two_syncs)
    result = load([source.current], CONFIG)
    assert done[0] == 1
    assert result.ok, [str(d) for d in result.diagnostics]
    assert names(result) == SETS["N2"]


def test_a_prune_halfway_through_the_listing_is_seen(
        source: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing itself may see a revision half removed (rmtree goes file
    by file): what it lacks is no removal either."""
    source.switch("N2")
    real_scandir = os.scandir
    pruning = [0]

    def scandir(path: object) -> object:
        if not pruning[0]:  # the first listing meets a prune begun under it
            pruning[0] = 1
            source.switch("N1")
            (source.layout.revs / rev("N2") / "b.yaml").unlink()  # rmtree's first file
        return real_scandir(path)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", scandir)
    result = load([source.current], CONFIG)
    assert pruning[0]
    assert result.ok, [str(d) for d in result.diagnostics]
    assert names(result) in (SETS["N1"], SETS["N2"]), sorted(names(result))


def test_no_consistent_read_fails_the_directory_never_reads_absent(
        source: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched and pruned under every attempt: the load gives up (bounded)
    and what it could not read fails to load: frozen (safety rule 3), and
    the daemon releases nothing while a file fails."""
    source.switch("N")

    def churn() -> None:
        source.made += 1
        name = f"R{source.made}"
        source.add(name, N1)
        source.switch(name)
        source.prune()
        source.switch(name)  # previous is the new one too: the old goes at once
        source.prune()

    done = after_listing(monkeypatch, churn, times=1000)
    result = load([source.current], CONFIG)
    assert not result.ok
    assert source.current in result.failed_files, result.failed_files
    assert any(d.file == source.current and "changed while it was read" in d.message
               for d in result.diagnostics), [str(d) for d in result.diagnostics]
    assert 1 < done[0] <= loader.PIN_ATTEMPTS, done[0]  # bounded
