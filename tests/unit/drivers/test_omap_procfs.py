"""Issue 26.4 at the driver edge: an omap key, a process name or a path that
is not UTF-8 costs only itself.

The rados binding decodes each omap key as it iterates and raises
UnicodeDecodeError for one that is not UTF-8, after its C iterator has moved
past it: ``RadosLikeIterator`` does the same (rados.pyx ``OmapIterator``),
so these run without a cluster. tests/cluster/test_undecodable.py shows it
on the real one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.drivers import fusemapper, omap, procfs

EXAMPLES = int(os.environ.get("RBD_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


class RadosLikeIterator:
    """Entries as the OSD returns them (bytes keys, sorted); each key decoded
    as the binding decodes it, after the C iterator advanced."""

    def __init__(self, entries: list[tuple[bytes, bytes]]) -> None:
        self._entries = iter(entries)

    def __iter__(self) -> RadosLikeIterator:
        return self

    def __next__(self) -> tuple[str, bytes]:
        key, value = next(self._entries)
        return key.decode("utf-8"), value


class FakeIoctx:
    """One object's omap, read as ``get_omap_vals`` reads it."""

    def __init__(self, omap_: dict[bytes, bytes]) -> None:
        self.omap = dict(sorted(omap_.items()))
        self.reads: list[tuple[str, int]] = []

    def get_omap_vals(self, _op: object, after: str, prefix: str, most: int
                      ) -> tuple[RadosLikeIterator, int]:
        self.reads.append((after, most))
        found = [(k, v) for k, v in self.omap.items()
                 if k > after.encode() and k.startswith(prefix.encode())][:most]
        return RadosLikeIterator(found), 0

    def operate_read_op(self, _op: object, _oid: str) -> None:
        pass


keys = st.binary(min_size=1, max_size=12)


@settings(FUZZ)
@given(st.dictionaries(keys, st.binary(max_size=8), max_size=30))
def test_entries_reads_every_text_key_past_those_that_are_not(raw: dict[bytes, bytes]) -> None:
    got, bad = omap.entries(RadosLikeIterator(sorted(raw.items())))
    text = {k: v for k, v in raw.items() if _utf8(k)}
    assert got == {k.decode(): v for k, v in text.items()}
    assert sorted(bad) == sorted(k for k in raw if not _utf8(k))


@settings(FUZZ)
@given(st.dictionaries(st.binary(max_size=6).map(lambda b: b"p_" + b), st.binary(max_size=4),
                       max_size=40), st.integers(1, 5))
def test_scan_pages_past_keys_that_are_not_text(raw: dict[bytes, bytes], page: int) -> None:
    """A page that ends on such a key cannot be continued from it (the
    binding takes the key to start after as str): it is read again, larger."""
    io = FakeIoctx({**raw, b"other": b"x"})
    got, bad = omap.scan(io, "obj", "p_", page)  # type: ignore[arg-type]
    assert got == {k.decode(): v for k, v in raw.items() if _utf8(k)}
    assert sorted(bad) == sorted(k for k in raw if not _utf8(k))


def test_scan_gives_up_on_more_such_keys_than_one_read_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(omap, "MAX_PAGE", 4)
    io = FakeIoctx({b"p_\xff%d" % i: b"" for i in range(8)})
    with pytest.raises(omap.Unpageable):
        omap.scan(io, "obj", "p_", 1)  # type: ignore[arg-type]


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- /proc ---------------------------------------------------------------------------
names = st.binary(min_size=1, max_size=15).filter(lambda b: b"\0" not in b and b"\n" not in b)


@settings(FUZZ)
@given(names)
def test_a_process_name_that_is_not_text_is_read(tmp_path_factory: pytest.TempPathFactory,
                                                 name: bytes) -> None:
    """Any process may name itself anything (prctl PR_SET_NAME): its stat line
    is read, name and fields, and the name keeps its bytes."""
    stat = tmp_path_factory.mktemp("proc") / "stat"
    stat.write_bytes(b"4242 (" + name + b") S 1 4242 4242 0 -1 4194560 " + b"0 " * 12 + b"77\n")
    comm, fields = procfs.stat_fields(stat)
    assert os.fsencode(comm) == name
    assert fields[:3] == ["S", "1", "4242"] and fields[19] == "77"


def test_an_rbd_fuse_helper_named_anything_is_still_found(tmp_path: Path) -> None:
    """The helper scan reads every process's stat: one whose name is not
    text must not stop it (it raised UnicodeDecodeError before)."""
    pid = tmp_path / "4242"
    pid.mkdir()
    (pid / "cmdline").write_bytes(b"/usr/bin/rbd-fuse\0--image=x\0/var/lib/r/fuse/rbd@\xff\0-f\0")
    (pid / "stat").write_bytes(b"4242 (rbd-\xff) S 1 4242 4242 0\n")
    assert fusemapper._helper_args(pid) == {os.fsdecode(b"/var/lib/r/fuse/rbd@\xff")}


def test_a_loop_device_backed_by_a_path_that_is_not_text_is_listed(tmp_path: Path) -> None:
    for n, back in ((0, b"/srv/\xff\xfe.img\n"), (1, b"/srv/plain.img\n")):
        d = tmp_path / f"loop{n}" / "loop"
        d.mkdir(parents=True)
        (d / "backing_file").write_bytes(back)
    got = {lo.name: lo.back_file for lo in fusemapper.loop_devices(tmp_path)}
    assert got == {"/dev/loop0": os.fsdecode(b"/srv/\xff\xfe.img"),
                   "/dev/loop1": "/srv/plain.img"}
