"""Stat-first loading: a file whose (device, inode, size, mtime, ctime) did
not change is neither opened nor parsed again; a changed one always is, even
at the same size and mtime; the trust and cross-file checks run every load."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from reconciler.spec import loader, reading
from reconciler.spec.config import default_config
from reconciler.spec.desired import load_desired
from reconciler.spec.loader import LoadCache, load

CONFIG = default_config()


def doc(name: str, image: str | None = None, size: str = "1Gi") -> str:
    return (f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
            f"spec:\n  image: {{pool: rbd, name: {image or name}, size: {size}}}\n")


@dataclasses.dataclass
class Counts:
    parsed: int = 0
    opened: int = 0


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Counts:
    """Parses of any file and opens of files under tmp_path, passed through."""
    c = Counts()
    parse, open_ = loader.load_documents, os.open

    def counting_parse(text: str) -> object:
        c.parsed += 1
        return parse(text)

    def counting_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        # A file by its path, or by its name in a pinned directory; not the
        # directory's own open (once a load).
        if not flags & os.O_DIRECTORY and (str(path).startswith(str(tmp_path))
                                           or kwargs.get("dir_fd") is not None):
            c.opened += 1
        return open_(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "load_documents", counting_parse)
    monkeypatch.setattr(os, "open", counting_open)
    return c


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written by the test count as settled at once (see RACY_NS)."""
    monkeypatch.setattr(loader, "RACY_NS", 0)


def test_second_load_of_200_unchanged_files_reads_none(tmp_path: Path, counts: Counts,
                                                        settled: None) -> None:
    for i in range(200):
        (tmp_path / f"v{i}.yaml").write_text(doc(f"v{i}"))
    cache = LoadCache()
    first = load([tmp_path], CONFIG, cache)
    assert first.ok and len(first.volumes) == 200
    assert (counts.parsed, counts.opened, cache.parsed) == (200, 200, 200)
    second = load([tmp_path], CONFIG, cache)
    assert (counts.parsed, counts.opened, cache.parsed) == (200, 200, 200)
    assert second == first
    assert load([tmp_path], CONFIG) == first  # without a cache: as before


def test_changed_file_is_read_again_at_the_same_size_and_mtime(
        tmp_path: Path, counts: Counts, settled: None) -> None:
    f = tmp_path / "v.yaml"
    f.write_text(doc("v", size="1Gi"))
    before = f.stat()
    cache = LoadCache()
    assert load([tmp_path], CONFIG, cache).volumes[0].image.size == 1 << 30
    # Rewritten in place, same length, the mtime put back: the ctime moved.
    f.write_text(doc("v", size="2Gi"))
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = f.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert load([tmp_path], CONFIG, cache).volumes[0].image.size == 2 << 30
    # Replaced by rename (a new inode), the mtime put back.
    tmp = tmp_path / ".v.yaml.new"
    tmp.write_text(doc("v", size="3Gi"))
    os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(tmp, f)
    assert load([tmp_path], CONFIG, cache).volumes[0].image.size == 3 << 30
    assert cache.parsed == 3


def test_file_written_just_before_it_was_read_is_read_again(tmp_path: Path,
                                                           counts: Counts) -> None:
    """Its timestamps could stay put through another write (a coarse clock)."""
    (tmp_path / "v.yaml").write_text(doc("v"))
    cache = LoadCache()
    load([tmp_path], CONFIG, cache)
    load([tmp_path], CONFIG, cache)
    assert counts.parsed == 2


def test_cross_file_checks_run_on_every_load(tmp_path: Path, settled: None) -> None:
    (tmp_path / "a.yaml").write_text(doc("a"))
    (tmp_path / "b.yaml").write_text(doc("b"))
    cache = LoadCache()
    assert load([tmp_path], CONFIG, cache).ok
    (tmp_path / "c.yaml").write_text(doc("c", image="a"))
    clash = load([tmp_path], CONFIG, cache)
    assert {d.file.name for d in clash.diagnostics} == {"a.yaml", "c.yaml"}
    assert [v.name for v in clash.volumes] == ["b"]
    (tmp_path / "c.yaml").unlink()
    again = load([tmp_path], CONFIG, cache)  # the cached results kept no diagnostic
    assert again.ok and [v.name for v in again.volumes] == ["a", "b"]
    assert set(cache.entries) == {tmp_path / "a.yaml", tmp_path / "b.yaml"}


def test_trust_checks_apply_to_cached_files(tmp_path: Path, settled: None) -> None:
    f = tmp_path / "v.yaml"
    f.write_text(doc("v"))
    cache = LoadCache()
    assert load([tmp_path], CONFIG, cache).ok
    f.chmod(0o666)
    refused = load([tmp_path], CONFIG, cache)
    assert refused.refused and refused.volumes == ()
    assert "refusing to read it" in refused.diagnostics[0].message
    f.chmod(0o644)
    assert load([tmp_path], CONFIG, cache).ok


def test_another_config_starts_afresh(tmp_path: Path, settled: None) -> None:
    (tmp_path / "v.yaml").write_text(doc("v") + "  map: {}\n")
    cache = LoadCache()
    assert load([tmp_path], CONFIG, cache).volumes[0].map.mapper == "auto"  # type: ignore
    krbd = dataclasses.replace(CONFIG, mapper="krbd")
    assert load([tmp_path], krbd, cache).volumes[0].map.mapper == "krbd"  # type: ignore


def test_load_desired_keeps_operator_and_csi_files(tmp_path: Path, counts: Counts,
                                                   settled: None) -> None:
    desired, csi = tmp_path / "desired", tmp_path / "state" / "csi.d"
    csi.mkdir(parents=True)
    desired.mkdir()
    config = dataclasses.replace(CONFIG, desired_dir=desired, state_dir=tmp_path / "state")
    assert config.csi_dir == csi
    (desired / "a.yaml").write_text(doc("a"))
    (csi / "b.yaml").write_text(doc("b"))
    cache = LoadCache()
    first = load_desired(config, cache)
    assert [v.name for v in first.volumes] == ["a", "b"]
    assert load_desired(config, cache) == first and counts.parsed == 2


def test_a_load_of_unchanged_files_is_the_last_result(tmp_path: Path, settled: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With every file unchanged, the checks across files are not run again
    (a pass beside 1,000 unchanged volumes); any change runs them."""
    for i in range(20):
        (tmp_path / f"v{i}.yaml").write_text(doc(f"v{i}"))
    checks = []
    real = loader.cross_file_checks
    monkeypatch.setattr(loader, "cross_file_checks",
                        lambda r, s=None: (checks.append(1), real(r, s))[1])
    cache = LoadCache()
    first = load([tmp_path], CONFIG, cache)
    assert load([tmp_path], CONFIG, cache) is first and len(checks) == 1
    (tmp_path / "v3.yaml").write_text(doc("v3", size="2Gi"))
    changed = load([tmp_path], CONFIG, cache)
    assert changed is not first and len(checks) == 2
    assert {v.name: v.image.size for v in changed.volumes}["v3"] == 2 << 30
    (tmp_path / "v4.yaml").chmod(0o664)  # trust is checked on every load, memo or not
    assert load([tmp_path], CONFIG, cache).refused


def test_an_unchanged_directory_is_not_listed_again(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reading, "LISTING_RACY_NS", 0)
    monkeypatch.setattr(reading, "_LISTINGS", {})
    (tmp_path / "a.yaml").write_text(doc("a"))
    scans = []
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p: (scans.append(p), real(p))[1])
    assert reading.discover([tmp_path])[0] == [tmp_path / "a.yaml"]
    assert reading.discover([tmp_path])[0] == [tmp_path / "a.yaml"]
    assert len(scans) == 1
    # A new entry moves the directory's timestamps (put a second ahead here,
    # so that a coarse clock cannot hide the change from the test).
    before = tmp_path.stat()
    (tmp_path / "b.yaml").write_text(doc("b"))
    os.utime(tmp_path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert reading.discover([tmp_path])[0] == [tmp_path / "a.yaml", tmp_path / "b.yaml"]
    assert len(scans) == 2
