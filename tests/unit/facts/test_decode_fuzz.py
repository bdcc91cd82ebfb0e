"""Issue 26.4: everything read from Ceph or the node is decoded defensively.

Each reader of bytes someone else chose (image-meta, the claim, mountinfo,
uevents, kernel log records, command output, superblocks) gets generated
input: arbitrary bytes, recorded input with bytes changed, and well-formed
input carrying names that are not UTF-8. Each property asserts the
documented outcome (a value, None, or the one exception type its callers
turn into a per-volume unknown or refusal), never another exception.
Several failed on the code before: ``parse_mountinfo`` took only str
(mountinfo was read as strict UTF-8) and split lines at a vertical tab in a
path (hiding that mount), the claim and a LUKS2 header recursed out on
"[[[[...", ``parse_io_max`` and ``parse_xfs_info_size`` raised on digits
``int()`` refuses, the JSON listings raised KeyError and TypeError. For a
longer run:

    RBD_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/unit/facts/test_decode_fuzz.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reconciler.facts import claim, kmsg, luks, meta, parsers, text
from reconciler.facts.observed import Mount
from reconciler.facts.uevent import Uevent, parse_uevent

DATA = Path(__file__).resolve().parents[2] / "data"
EXAMPLES = int(os.environ.get("RBD_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.fuzz

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
DEEP = "[" * 100_000  # json.loads raises RecursionError, which is not a ValueError


@st.composite
def mutated(draw: st.DrawFn, recorded: bytes) -> bytes:
    """Recorded bytes with a few bytes replaced, inserted or cut out."""
    data = bytearray(recorded)
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(("replace", "insert", "cut")))
        chunk = draw(st.binary(min_size=1, max_size=6))
        if how == "replace":
            data[at:at + len(chunk)] = chunk
        elif how == "insert":
            data[at:at] = chunk
        else:
            del data[at:at + len(chunk)]
    return bytes(data)


# -- mountinfo ---------------------------------------------------------------------
MOUNTINFO = (DATA / "mountinfo.txt").read_bytes()


@FUZZ
@given(st.binary(max_size=600) | mutated(MOUNTINFO))
def test_mountinfo_of_any_bytes_is_mounts(raw: bytes) -> None:
    got = parsers.parse_mountinfo(raw)
    assert isinstance(got, tuple) and all(isinstance(m, Mount) for m in got)


def _kernel_escape(path: bytes) -> bytes:
    """What the kernel writes for a path in mountinfo: space, tab, newline and
    backslash as octal escapes, every other byte as it is."""
    return re.sub(rb"[ \t\n\\]", lambda m: b"\\%03o" % m[0][0], path)


paths = st.binary(min_size=1, max_size=30).filter(lambda b: b"\0" not in b).map(
    lambda b: b"/" + b)


@FUZZ
@given(st.lists(paths, min_size=1, max_size=6), st.integers(0, 5))
def test_a_path_that_is_not_text_costs_only_its_own_line(foreign: list[bytes],
                                                         at: int) -> None:
    """Every line is read, whatever bytes its neighbours' paths hold; each
    mount point is the bytes the kernel had (``os.fsdecode``), so one that is
    not UTF-8 never equals a path of ours and still names the same file."""
    ours = "/srv/app data/pgdata"  # text, with a space the kernel escapes
    points = [*foreign]
    points.insert(min(at, len(points)), ours.encode())
    text = b"".join(b"%d 1 7:%d / %s rw,nosuid - ext4 /dev/loop%d rw\n"
                    % (100 + i, i, _kernel_escape(p), i) for i, p in enumerate(points))
    got = parsers.parse_mountinfo(text)
    assert [m.mount_point for m in got] == [os.fsdecode(p) for p in points]
    assert [m.mount_point for m in got].count(ours) == points.count(ours.encode())


# -- uevents -------------------------------------------------------------------------
UEVENT = (DATA / "uevent_loop_change.bin").read_bytes()


@FUZZ
@given(st.binary(max_size=600) | mutated(UEVENT))
def test_a_uevent_of_any_bytes_is_an_event_or_nothing(raw: bytes) -> None:
    got = parse_uevent(raw)
    assert got is None or isinstance(got, Uevent)
    if got is not None:
        assert all(isinstance(v, str) for v in (got.action, got.devpath, *got.env.values()))


@FUZZ
@given(st.binary(max_size=40).filter(lambda b: b"\0" not in b))
def test_a_field_that_is_not_text_leaves_the_device_named(junk: bytes) -> None:
    got = parse_uevent(UEVENT + b"\0JUNK=" + junk + b"\0")
    assert got is not None and got.devname == "loop0" and got.action == "change"


@FUZZ
@given(st.binary(max_size=300) | st.binary(max_size=200).map(
    lambda b: b"3,1042,5000,-;EXT4-fs error (device " + b + b"): bad\n SUBSYSTEM=block\n"))
def test_a_kernel_log_record_of_any_bytes_is_a_message_or_nothing(raw: bytes) -> None:
    got = kmsg.parse_kmsg(raw)
    assert got is None or isinstance(got, kmsg.KernelMessage)
    if got is not None:
        assert all(isinstance(d, str) for d in kmsg.devices_named(got.text))


# -- image-meta and the claim ------------------------------------------------------
values = st.binary(max_size=60) | st.text(max_size=30).map(str.encode)


@FUZZ
@given(st.dictionaries(st.text(max_size=20), values, max_size=8))
def test_image_meta_is_text_or_unreadable_key_by_key(raw: dict[str, bytes]) -> None:
    text, unreadable = meta.decode(raw)
    assert set(text) | set(unreadable) == set(raw) and not set(text) & set(unreadable)
    for key, value in text.items():
        assert value.encode() == raw[key]
    for why in unreadable.values():
        assert why.startswith("not UTF-8 text (") and why.isascii()


@FUZZ
@given(values)
@example(b"\xff\xfe\x80")
@example(DEEP.encode())
def test_a_claim_is_a_claim_nobody_or_unreadable(raw: bytes) -> None:
    """The holder as librbd stores it: a claim, none, or Unreadable (which
    makes the volume unknown), never anything else."""
    try:
        text = meta.text(meta.HOLDER, raw)
    except meta.Unreadable as exc:
        assert meta.HOLDER in str(exc) and str(exc).isascii()
        return
    got = claim.parse(text)
    assert got is None or isinstance(got, claim.Claim)


@FUZZ
@given(json_values)
@example([[[["deep"]]]])
def test_a_claim_of_any_json_is_a_claim_or_nobody(doc: object) -> None:
    got = claim.parse(json.dumps(doc))
    assert got is None or (isinstance(got, claim.Claim) and isinstance(got.node, str))
    if got is not None:
        _shown_safely(got)


def _shown_safely(got: claim.Claim) -> None:
    """Whatever wrote it, what a claim shows can go to a terminal or a log."""
    for name in (got.node, got.taken_from or "", *got.clients, *got.fenced):
        assert not text.FORBIDDEN.search(name) and len(name) <= text.MAX_NAME, name
    assert len(got.clients) <= claim.MAX_ADDRS and len(got.fenced) <= claim.MAX_ADDRS


@FUZZ
@given(st.text(max_size=400), st.text(max_size=40))
@example("evil\x1b]0;pwned\x07\nnode-a", "a\u202eb")
def test_a_claim_shows_a_name_no_node_config_allows_escaped(node: str, other: str) -> None:
    got = claim.parse(json.dumps({"node": node, "takenFrom": other,
                                  "clients": [other] * 100, "fenced": [node]}))
    assert got is not None
    _shown_safely(got)
    if text.NODE_NAME.fullmatch(node):
        assert got.node == node  # a name a node may have is that name


def test_a_claim_nested_too_deeply_is_a_foreign_name() -> None:
    assert claim.parse(DEEP) == claim.Claim(text.shown_name(DEEP))  # was: RecursionError


# -- command output ----------------------------------------------------------------
outputs = (st.text(max_size=300) | json_values.map(json.dumps)
           | st.lists(st.dictionaries(st.sampled_from(
               ("pool", "name", "image", "snap", "device", "namespace", "id")), json_values,
               max_size=6), max_size=3).map(json.dumps)
           | st.just(DEEP))


@FUZZ
@given(outputs | mutated((DATA / "rbd_device_list_krbd.json").read_bytes()).map(
    lambda b: b.decode("utf-8", "replace")))
def test_rbd_device_list_is_mappings_or_a_value_error(text: str) -> None:
    try:
        got = parsers.parse_rbd_device_list(text)
    except ValueError:
        return  # KernelMapper.list: a failed listing, said so
    assert all(isinstance(d.image, str) and isinstance(d.device, str) for d in got)


@FUZZ
@given(outputs | mutated((DATA / "losetup_fuse_and_deleted.json").read_bytes()).map(
    lambda b: b.decode("utf-8", "replace")))
def test_losetup_json_is_loop_devices_or_a_value_error(text: str) -> None:
    try:
        got = parsers.parse_losetup_json(text)
    except ValueError:
        return
    assert all(isinstance(d.name, str) for d in got)


texts = st.text(max_size=300) | st.binary(max_size=300).map(
    lambda b: b.decode("utf-8", "replace"))
BIG = "9" * 5000  # more digits than int() takes (sys.get_int_max_str_digits)


@FUZZ
@given(texts, st.integers(-5, 5))
def test_blkid_is_a_probe_or_a_value_error(text: str, rc: int) -> None:
    try:
        got = parsers.parse_blkid_export(text, rc)
    except ValueError:
        assert rc not in (0, 2)
        return
    assert isinstance(got, parsers.Probe)


@FUZZ
@given(texts)
@example(f"data     =   bsize={BIG} blocks=1")
@example(f"Block count: {BIG}\nBlock size: 4096")
def test_filesystem_sizes_are_a_size_or_unknown(text: str) -> None:
    for fn in (parsers.parse_dumpe2fs_size, parsers.parse_xfs_db_size,
               parsers.parse_xfs_info_size):
        got = fn(text)
        assert got is None or isinstance(got, int)


@FUZZ
@given(texts)
@example("7:0 riops=\u00b2 wbps=max")  # "²".isdigit(), but not int("²")
@example(f"7:0 riops={BIG}")
@example("IOReadIOPSMax=/dev/rbd0 \u00b2")
def test_io_limits_are_limits(text: str) -> None:
    for fn in (parsers.parse_io_max, parsers.parse_systemd_io):
        got = fn(text)
        assert all(isinstance(v, int) for limits in got.values() for v in limits.values())


@FUZZ
@given(st.sampled_from(("krbd", "nbd", "fuse")), st.integers(-300, 300), texts)
def test_a_map_failure_is_a_map_error(kind: str, rc: int, stderr: str) -> None:
    assert isinstance(parsers.explain_map_failure(kind, rc, stderr), parsers.MapError)


# -- what a device holds (an image's contents are anyone's) ----------------------------
@FUZZ
@given(st.binary(min_size=0, max_size=2200))
def test_superblocks_are_a_superblock_or_none(head: bytes) -> None:
    for fs in ("ext4", "xfs", "btrfs"):
        got = parsers.parse_superblock(head, fs)
        assert got is None or isinstance(got, parsers.Superblock)


def _luks2(area: bytes) -> bytes:
    size = luks.JSON_START + max(len(area) + 1, 16)
    return (luks.MAGIC + (2).to_bytes(2, "big") + size.to_bytes(8, "big")).ljust(
        luks.JSON_START, b"\0") + area + b"\0"


@FUZZ
@given(st.binary(max_size=200) | json_values.map(lambda d: json.dumps(d).encode()))
@example(DEEP.encode())
def test_a_luks2_json_area_is_an_offset_or_none(area: bytes) -> None:
    got = luks.data_offset(_luks2(area))
    assert got is None or isinstance(got, int)
