"""Attacks on "a pass reads exactly one revision" (issue 36, item 1).

Each test plays a desired-file author, a racing deploy tool, or a fault,
against the loader's pinned directory (spec/pinned.py: Pin, Pins), and
states what must hold: one revision read, nothing unreadable taken as
absent (safety rules 3 and 7), nothing followed out (rules 6 and 8), no
descriptor left open.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_one_revision import N1, SETS, N, Source, after_listing, doc, names, rev

from reconciler.spec import loader, reading
from reconciler.spec.config import default_config
from reconciler.spec.loader import LoadCache, load

CONFIG = default_config()


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Source:
    monkeypatch.setattr(loader, "RACY_NS", 0)
    monkeypatch.setattr(reading, "LISTING_RACY_NS", 0)
    monkeypatch.setattr(reading, "_LISTINGS", {})
    src = Source(tmp_path / "source")
    src.add("N", N)
    src.add("N1", N1)
    return src


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- descriptors ---------------------------------------------------------------

def test_a_path_that_cannot_be_opened_at_all_is_a_diagnostic_and_leaks_nothing(
        source: Source) -> None:
    """A path no open(2) accepts (a NUL in it: ValueError, not OSError) was
    a diagnostic before the pin; it must not raise out of load ("errors
    never raise"), nor leave the pins opened before it open."""
    source.switch("N")
    bad = Path("/nonexistent\0/volumes.d")
    before = open_fds()
    for _ in range(20):
        result = load([source.current, bad], CONFIG)
        assert not result.ok
        assert any(d.file == bad for d in result.diagnostics), \
            [str(d) for d in result.diagnostics]
    assert open_fds() == before


def test_no_load_leaves_a_descriptor_open(source: Source, monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    """Every way a load ends: read, cached, refused, missing, torn on every
    attempt, and an exception out of the middle of it."""
    source.switch("N")
    cache = LoadCache()
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)  # world-writable: refused
    open_dir.chmod(0o777)
    (open_dir / "v.yaml").write_text(doc("v"))
    before = open_fds()
    for _ in range(10):
        assert load([source.current], CONFIG, cache).ok
        assert load([source.current], CONFIG).ok
        assert load([open_dir], CONFIG, cache).refused
        assert not load([tmp_path / "missing"], CONFIG).ok
    assert open_fds() == before

    def churn() -> None:
        source.made += 1
        name = f"R{source.made}"
        source.add(name, N1)
        source.switch(name)
        source.prune()
        source.switch(name)
        source.prune()

    after_listing(monkeypatch, churn, times=30)
    for _ in range(10):
        assert not load([source.current], CONFIG, cache).ok
    monkeypatch.undo()

    def boom(*_: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(loader, "cross_file_checks", boom)
    for _ in range(10):
        with pytest.raises(RuntimeError):
            load([source.current], CONFIG)
    assert open_fds() == before


# --- a directory that cannot be read is not an empty one (safety rule 7) --------

def test_a_link_that_leads_nowhere_when_loaded_fails_the_directory(source: Source) -> None:
    """A deploy tool that switches its link as unlink + symlink (busybox
    ln -sfn, rm && ln -s) leaves a moment with no desired directory at all.
    A load then must not read "no volumes": the directory fails to load
    (failed_files), so the daemon releases nothing it declared."""
    source.switch("N")
    source.current.unlink()
    result = load([source.current], CONFIG)
    assert not result.ok
    assert result.volumes == ()
    assert source.current in result.failed_files, result.failed_files


def test_a_directory_that_cannot_be_listed_fails_as_a_whole(
        source: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error listing the pinned directory: unreadable, not empty."""
    source.switch("N")
    real_scandir = os.scandir

    def scandir(path: object) -> object:
        if isinstance(path, int):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_scandir(path)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", scandir)
    result = load([source.current], CONFIG)
    assert not result.ok and result.volumes == ()
    assert source.current in result.failed_files, result.failed_files


def test_unreadable_and_torn_directories_keep_the_failed_files_of_their_volumes(
        source: Source) -> None:
    """The sanity of the above: a good load has no failed file."""
    source.switch("N1")
    result = load([source.current], CONFIG)
    assert result.ok and names(result) == SETS["N1"] and not result.failed_files
    assert rev("N1") in os.readlink(source.current)


def test_a_failure_to_list_is_not_kept_for_the_directory_once_it_is_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache keeps a result while the same files are there unchanged:
    none, for a directory that could not be read. The same directory back,
    empty, is read as it is now, not as the failure."""
    monkeypatch.setattr(reading, "_LISTINGS", {})
    desired = tmp_path / "volumes.d"
    cache = LoadCache()
    gone = load([desired], CONFIG, cache)
    assert not gone.ok and desired in gone.failed_files
    desired.mkdir(mode=0o755)
    back = load([desired], CONFIG, cache)
    assert back.ok, [str(d) for d in back.diagnostics]
    assert not back.failed_files


# --- what held (kept as regression tests) ----------------------------------------

def test_a_switch_between_the_open_and_the_realpath_is_read_again(
        source: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pin opens the link, then asks where it led (for the symlinked
    files' checks): a switch in between makes the pin unsure, and the load
    starts again rather than check one revision's path for another's files."""
    source.switch("N")
    real_realpath, done = os.path.realpath, [0]

    def realpath(path: object, **kwargs: object) -> str:
        if not done[0] and path == source.current:
            done[0] = 1
            source.switch("N1")
        return real_realpath(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os.path, "realpath", realpath)
    result = load([source.current], CONFIG)
    assert done[0]
    assert result.ok, [str(d) for d in result.diagnostics]
    assert names(result) == SETS["N1"]


def test_a_world_writable_revision_pinned_is_refused_though_the_link_moved_on(
        source: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    """The names on the way are checked after the pin, where the link leads
    then; the revision actually read is checked as it was opened."""
    bad = source.layout.revs / rev("N")
    bad.chmod(0o777)
    source.switch("N")
    switched = after_listing(monkeypatch, lambda: source.switch("N1"))
    result = load([source.current], CONFIG)
    assert switched[0] == 1
    assert result.refused and result.volumes == ()
    assert any("writable by group or others" in d.message for d in result.diagnostics)


@pytest.mark.parametrize("target", ["other revision", "outside"])
def test_a_symlinked_file_out_of_the_pinned_revision_is_never_opened(
        source: Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    elsewhere = (source.layout.revs / rev("N1") / "b.yaml" if target == "other revision"
                 else tmp_path / "x.yaml")
    if target == "outside":
        elsewhere.write_text(doc("x"))
    (source.layout.revs / rev("N") / "z.yaml").symlink_to(elsewhere)
    source.switch("N")
    opened: list[str] = []
    real_open = os.open

    def spy(path: object, *args: object, **kwargs: object) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", spy)
    result = load([source.current], CONFIG, LoadCache())
    assert result.refused and result.volumes == ()
    assert str(elsewhere) not in opened


def test_a_file_made_a_symlink_out_after_the_listing_is_refused_or_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a plain directory (no link to pin): a.yaml replaced by a symlink
    to a file outside between the listing and the open."""
    monkeypatch.setattr(reading, "_LISTINGS", {})
    desired = tmp_path / "volumes.d"
    desired.mkdir(mode=0o755)
    (desired / "a.yaml").write_text(doc("gx"))
    outside = tmp_path / "evil.yaml"
    outside.write_text(doc("evil"))

    def swap() -> None:
        (desired / "a.yaml").unlink()
        (desired / "a.yaml").symlink_to(outside)

    after_listing(monkeypatch, swap)
    result = load([desired], CONFIG)
    assert "evil" not in names(result)
    assert result.refused, [str(d) for d in result.diagnostics]
